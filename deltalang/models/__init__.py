"""What a model is, read from transformers' code and a config: never its weights.

The families recognised from their modeling code (`families`), transformers' private internals in one place
with one adapter per release era (`internals`), the value catalogue (`values`: every value a block serves,
its shape and writability), a model's shape (`spec`), the bundled models and the tiny test checkpoints.
Imports only `ground`.
"""
