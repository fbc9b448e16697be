"""Running compiled programs: one prompt, a dataset, a collection, a shard of either.

`compiled` (an `Experiment` run on a model) and `results`; a program over a dataset record by record
(`dataset_run`, `dataset_generate`), saved as it goes (`dataset_store`), reads collected into sharded
safetensors (`collect`, `shard_file`) and read back (`collection`); a run split across processes (`shards`).
Imports every folder but `sweep`.
"""
