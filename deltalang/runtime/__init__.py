"""The value layer: serving every recurrent value inside the model's own kernel calls.

Kernel dispatch and routing (`kernels`, `backends`), the delta rule and the Mamba-2 scan in chunks
(`deltarule`, `ssd`), the mixer sites that serve reads and writes in a call (`mixer/`), loading and wrapping a
model (`model`), what a model serves (`info`), and gradients of a measure through the memory (`gradients`).
Imports `ground` and `models` only; knows nothing of the language.
"""
