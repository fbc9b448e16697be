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
    # pass 1: g
    with torch.no_grad(), model.generate(PROMPTS['clean'], max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[[0, 1, 2]]:
            if step == 0:
                results['g.step0.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # steps.dl:5
            if step == 1:
                results['g.step1.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # steps.dl:5
                results['s1'] = model.layers[1].linear_attn.state_input.save()  # steps.dl:7
            if step == 2:
                results['g.step2.L0.state_output'] = model.layers[0].linear_attn.state_output.save()  # steps.dl:5
                model.layers[1].linear_attn.state_input = torch.zeros_like(model.layers[1].linear_attn.state_input)  # steps.dl:6
        results['g.tokens'] = tracer.result[:, 34:].save()  # steps.dl:8 the new tokens
    return {k: v for k, v in results.items() if not k.startswith('~')}


if __name__ == "__main__":
    model = deltalang.load_model(MODEL)
    print(deltalang.Results(experiment(model), model=model))
