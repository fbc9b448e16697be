"""nnsight code compiled by deltalang 0.1.0 from steps.dl.

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
    # pass 1: plain
    with torch.no_grad(), model.generate(PROMPTS['clean'], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[[0, 1, 2]]:
            if step == 0:
                results['~plain.step0.logits'] = model.logits.save()  # steps.dl:11
            if step == 1:
                results['~plain.step1.logits'] = model.logits.save()  # steps.dl:11
            if step == 2:
                results['~plain.step2.logits'] = model.logits.save()  # steps.dl:11
        results['plain.tokens'] = tracer.result[:, 34:].save()  # steps.dl:5 the new tokens
    # pass 2: g
    with torch.no_grad(), model.generate(PROMPTS['clean'], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[[0, 1, 2]]:
            if step == 0:
                results['g.step0.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # steps.dl:8
                results['~g.step0.logits'] = model.logits.save()  # steps.dl:11
            if step == 1:
                results['g.step1.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # steps.dl:8
                results['s1'] = model.layers[1].linear_attn.state_input.save()  # steps.dl:10
                results['~g.step1.logits'] = model.logits.save()  # steps.dl:11
            if step == 2:
                results['g.step2.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # steps.dl:8
                model.layers[1].linear_attn.state_input = torch.zeros_like(model.layers[1].linear_attn.state_input)  # steps.dl:9
                results['~g.step2.logits'] = model.logits.save()  # steps.dl:11
        results['g.tokens'] = tracer.result[:, 34:].save()  # steps.dl:12 the new tokens
    results['g.step0.kl(plain)'] = measures.kl(results['~g.step0.logits'], results['~plain.step0.logits'])  # steps.dl:11
    results['g.step1.kl(plain)'] = measures.kl(results['~g.step1.logits'], results['~plain.step1.logits'])  # steps.dl:11
    results['g.step2.kl(plain)'] = measures.kl(results['~g.step2.logits'], results['~plain.step2.logits'])  # steps.dl:11
    return {k: v for k, v in results.items() if not k.startswith('~')}


KINDS = {  # what a result holds where its name does not say it: how `deltalang run` prints it (Results.summary)
    's1': 'state_input',
    'g.step0.kl(plain)': 'kl',
    'g.step1.kl(plain)': 'kl',
    'g.step2.kl(plain)': 'kl',
}


if __name__ == "__main__":
    model = deltalang.load_model(MODEL)
    results = deltalang.Results(experiment(model), model=model, kinds=KINDS)
    print(results.summary())
