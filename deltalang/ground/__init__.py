"""The ground floor: what every layer uses and that knows nothing of models or programs.

Errors and warnings (`errors`), how a table shows a number or a token (`display`), the measure functions
(`measures`, one dispatch for emitted code and the sweep engine), dataset records (`datasets`), notebook HTML
(`html`), tested versions (`compat`, `version`), and process settings (`quiet`, `allocator`).
Imports nothing of deltalang outside this folder.
"""
