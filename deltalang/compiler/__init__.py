"""The compiler: a resolved program to forward passes in forward order, and nnsight source.

`batches` (which runs share a forward), `directions` (means and projections planned in earlier passes),
`plan`, `emit` (the readable nnsight program), `explain` (what `check` and `emit --plan` print), `shown`
(how each result is shown, for `Results` and the emitted script).
Imports `ground`, `models` and `language`; never the runtime.
"""
