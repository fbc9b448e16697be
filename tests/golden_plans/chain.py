"""nnsight code compiled by deltalang 0.1.0 from chain.dl.

Ops are in the order the forward reaches them; each comment names its program line.
Run it as a script, or call experiment(model) on a deltalang.load_model(...) model.
"""
import torch

import deltalang
from deltalang import measures

MODEL = '<tiny qwen3_5>'  # None: the bundled model
PROMPTS = {
    'p': 'The Eiffel Tower is in the city of',
    'q': 'My favourite food is pizza with',
}


def experiment(model):
    results = {}
    # pass 1: d, a
    with torch.no_grad(), model.trace(logits_to_keep=1) as tracer:
        with tracer.invoke(PROMPTS['q']):  # d (31 tokens, 3 padding)
            results['d.L0.state_input'] = model.layers[0].linear_attn.state_input.save()  # chain.dl:7
        with tracer.invoke(PROMPTS['p']):  # a (34 tokens, 0 padding)
            model.layers[0].linear_attn.set_state_after(2, model.layers[0].linear_attn.state_after(2) * 0.5)  # chain.dl:6 token 2 = e
            results['a.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # chain.dl:6
            results['~a.L1.state_after(4)'] = model.layers[1].linear_attn.state_after(4).save()  # chain.dl:5 token 4 = E
    # pass 2: b
    with torch.no_grad(), model.trace(PROMPTS['q'], logits_to_keep=1):
        model.layers[1].linear_attn.set_state_after(4, results['~a.L1.state_after(4)'])  # chain.dl:5 token 4 = a
        results['b_state'] = model.layers[1].linear_attn.state_output.save()  # chain.dl:5
        results['~b.L2.state_after(4)'] = model.layers[2].linear_attn.state_after(4).save()  # chain.dl:4 token 4 = a
    # pass 3: c
    with torch.no_grad(), model.trace(PROMPTS['p'], logits_to_keep=1):
        model.layers[2].linear_attn.set_state_after(4, results['~b.L2.state_after(4)'])  # chain.dl:4 token 4 = E
        results['c.next_token_probs'] = model.next_token_probs.save()  # chain.dl:4
    return {k: v for k, v in results.items() if not k.startswith('~')}


KINDS = {  # what a result holds where its name does not say it: how `deltalang run` prints it (Results.summary)
    'b_state': 'state_output',
}


if __name__ == "__main__":
    model = deltalang.load_model(MODEL)
    results = deltalang.Results(experiment(model), model=model, kinds=KINDS)
    print(results.summary())
