"""Training: ``launch/train.py``, its loop and backends (DeepSpeed, Megatron-core, torch), installed as
``dattri_ds.launch``."""
