"""nnsight code compiled by deltalang 0.1.0 from order.dl.

Ops are in the order the forward reaches them; each comment names its program line.
Run it as a script, or call experiment(model) on a deltalang.load_model(...) model.
"""
import torch

import deltalang
from deltalang import measures

MODEL = '<tiny qwen3_5>'  # None: the bundled model
PROMPTS = {
    'clean': 'The Eiffel Tower is in the city of',
}


def experiment(model):
    results = {}
    # pass 1: t
    with torch.no_grad(), model.trace(PROMPTS['clean'], logits_to_keep=1):
        results['t.L0.conv_window_after(5)'] = model.layers[0].linear_attn.conv_window_after(5).save()  # order.dl:13 token 5 = i
        results['t.L0.decays'] = model.layers[0].linear_attn.decays.save()  # order.dl:12
        results['t.L0.attention_output'] = model.layers[0].linear_attn.attention_output.save()  # order.dl:11
        model.layers[1].linear_attn.set_state_after(3, torch.zeros_like(model.layers[1].linear_attn.state_after(3)))  # order.dl:8 token 3 = ␣
        results['t.L1.state_after(3)'] = model.layers[1].linear_attn.state_after(3).save()  # order.dl:9 token 3 = ␣
        results['t.L1.state_after(7)'] = model.layers[1].linear_attn.state_after(7).save()  # order.dl:7 token 7 = f
        results['t.L1.states'] = model.layers[1].linear_attn.states_as_run.save()  # order.dl:10
        results['t.L1.state_output'] = model.layers[1].linear_attn.state_output.save()  # order.dl:6
        results['t.L2.output'] = model.layers[2].output.save()  # order.dl:5
        results['t.next_token_probs'] = model.next_token_probs.save()  # order.dl:4
    return {k: v for k, v in results.items() if not k.startswith('~')}


KINDS = {  # what a result holds where its name does not say it: how `deltalang run` prints it (Results.summary)
    't.L0.conv_window_after(5)': 'conv_window_after',
    't.L1.state_after(3)': 'state_after',
    't.L1.state_after(7)': 'state_after',
}


if __name__ == "__main__":
    model = deltalang.load_model(MODEL)
    results = deltalang.Results(experiment(model), model=model, kinds=KINDS)
    print(results.summary())
