"""nnsight code compiled by deltalang 0.1.0 from tour.dl.

Ops are in the order the forward reaches them; each comment names its program line.
Run it as a script, or call experiment(model) on a deltalang.load_model(...) model.
"""
import torch

import deltalang
from deltalang import measures

MODEL = '<tiny qwen3_5>'  # None: the bundled model
PROMPTS = {
    'clean': 'The Eiffel Tower is in the city of',
    'other': 'My favourite food is pizza with',
}


def experiment(model):
    results = {}
    # pass 1: other (implicit), base
    with torch.no_grad(), model.trace(logits_to_keep=1) as tracer:
        with tracer.invoke(PROMPTS['other']):  # other (31 tokens, 3 padding)
            results['~other.L0.state_after(15)'] = model.layers[0].linear_attn.state_after(15).save()  # tour.dl:11 token 15 = o
            results['~other.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # tour.dl:18
            results['~other.L1.state_after(15)'] = model.layers[1].linear_attn.state_after(15).save()  # tour.dl:11 token 15 = o
            results['~other.L1.state_output'] = model.layers[1].linear_attn.state_output.save()  # tour.dl:18
            results['~other.L2.state_after(15)'] = model.layers[2].linear_attn.state_after(15).save()  # tour.dl:11 token 15 = o
            results['~other.L2.state_output'] = model.layers[2].linear_attn.state_output.save()  # tour.dl:18
        with tracer.invoke(PROMPTS['clean']):  # base (34 tokens, 0 padding)
            results['base.L0.state_input'] = model.layers[0].linear_attn.state_input.save()  # tour.dl:6
            results['base.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # tour.dl:6
            results['clean_probs'] = model.next_token_probs.save()  # tour.dl:7
    # pass 2: patched
    with torch.no_grad(), model.trace(PROMPTS['clean'], logits_to_keep=1):
        results['before'] = model.layers[0].linear_attn.state_after(2).save()  # tour.dl:12 token 2 = e
        model.layers[0].linear_attn.set_state_after(15, results['~other.L0.state_after(15)'])  # tour.dl:11 token 15 = r
        results['after'] = model.layers[0].linear_attn.state_after(33).save()  # tour.dl:13 token 33 = f
        model.layers[1].linear_attn.set_state_after(15, results['~other.L1.state_after(15)'])  # tour.dl:11 token 15 = r
        model.layers[2].linear_attn.set_state_after(15, results['~other.L2.state_after(15)'])  # tour.dl:11 token 15 = r
        results['patched.next_token_probs'] = model.next_token_probs.save()  # tour.dl:14
    # pass 3: cont
    with torch.no_grad(), model.generate(PROMPTS['clean'], max_new_tokens=4, min_new_tokens=4, do_sample=False) as tracer:
        for step in tracer.iter[1]:
            model.layers[0].linear_attn.state_input = results['~other.L0.state_output']  # tour.dl:18
            model.layers[1].linear_attn.state_input = results['~other.L1.state_output']  # tour.dl:18
            model.layers[2].linear_attn.state_input = results['~other.L2.state_output']  # tour.dl:18
        results['cont.tokens'] = tracer.result[:, 34:].save()  # tour.dl:19 the new tokens
    return {k: v for k, v in results.items() if not k.startswith('~')}


KINDS = {  # what a result holds where its name does not say it: how `deltalang run` prints it (Results.summary)
    'clean_probs': 'next_token_probs',
    'before': 'state_after',
    'after': 'state_after',
}


if __name__ == "__main__":
    model = deltalang.load_model(MODEL)
    results = deltalang.Results(experiment(model), model=model, kinds=KINDS)
    print(results.summary())
