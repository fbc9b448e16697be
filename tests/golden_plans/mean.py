"""nnsight code compiled by deltalang 0.1.0 from mean.dl.

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
    # pass 1: mean(corpus)[2]#2 (implicit), mean(corpus)[0]#0 (implicit), mean(corpus)[1]#1 (implicit)
    with torch.no_grad(), model.trace(logits_to_keep=1) as tracer:
        with tracer.invoke('Rain fell'):  # mean(corpus)[2]#2 (9 tokens, 4 padding)
            results['~mean(corpus)[2]#2.L1.state_after(2)'] = model.layers[1].linear_attn.state_after(2).save()  # mean.dl:6
        with tracer.invoke('The cat sat'):  # mean(corpus)[0]#0 (11 tokens, 2 padding)
            results['~mean(corpus)[0]#0.L1.state_after(2)'] = model.layers[1].linear_attn.state_after(2).save()  # mean.dl:6
        with tracer.invoke('A dog ran far'):  # mean(corpus)[1]#1 (13 tokens, 0 padding)
            results['~mean(corpus)[1]#1.L1.state_after(2)'] = model.layers[1].linear_attn.state_after(2).save()  # mean.dl:6
    results['~mean(corpus).L1.state_after(2).avg'] = torch.stack([results['~mean(corpus)[0]#0.L1.state_after(2)'], results['~mean(corpus)[1]#1.L1.state_after(2)'], results['~mean(corpus)[2]#2.L1.state_after(2)']]).mean(dim=0)
    # pass 2: avg
    with torch.no_grad(), model.trace(PROMPTS['clean'], logits_to_keep=1):
        results['kept'] = model.layers[0].linear_attn.state_after(1).save()  # mean.dl:5 token 1 = h
        model.layers[1].linear_attn.set_state_after(2, results['~mean(corpus).L1.state_after(2).avg'])  # mean.dl:6 token 2 = e
        results['~avg.logits'] = model.logits.save()  # mean.dl:11
        results['avg.next_token_probs'] = model.next_token_probs.save()  # mean.dl:7
    # pass 3: reuse
    with torch.no_grad(), model.trace(PROMPTS['clean'], logits_to_keep=1):
        model.layers[0].linear_attn.set_state_after(1, results['kept'])  # mean.dl:10 token 1 = h
        results['~reuse.L1.state_output'] = model.layers[1].linear_attn.state_output.save()  # mean.dl:12
        results['~reuse.logits'] = model.logits.save()  # mean.dl:11
    results['reuse.kl(avg)'] = measures.kl(results['~reuse.logits'], results['~avg.logits'])  # mean.dl:11
    results['reuse.norm(L1.state_output)'] = measures.norm(results['~reuse.L1.state_output'])  # mean.dl:12
    return {k: v for k, v in results.items() if not k.startswith('~')}


KINDS = {  # what a result holds where its name does not say it: how `deltalang run` prints it (Results.summary)
    'kept': 'state_after',
    'reuse.kl(avg)': 'kl',
    'reuse.norm(L1.state_output)': 'norm',
}


if __name__ == "__main__":
    model = deltalang.load_model(MODEL)
    results = deltalang.Results(experiment(model), model=model, kinds=KINDS)
    print(results.summary())
