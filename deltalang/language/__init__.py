"""The language: program text to a resolved program, checked against a model's shape.

Grammar, parser and syntax tree (`parse`, `ast`, `grammar/`), the resolver (`resolve/`: names, selectors,
positions, sources, datasets) producing `ir`, `check`, prompts as tokens (`tokens`), and the highlighter.
Imports `ground` and `models` only; never the runtime.
"""
