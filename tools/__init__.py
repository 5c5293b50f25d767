"""The dattri-ds commands, one file each (installed as ``dattri_ds.tools``), and what they share."""
