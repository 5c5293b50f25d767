"""dattri-ds: training data attribution and online data selection inside DeepSpeed/Megatron."""

from setuptools import setup

setup(
    name="dattri-ds",
    version="0.1.0",
    description="Per-example gradients, training data attribution and online data selection "
                "for DeepSpeed ZeRO and Megatron-core training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=["dattri_ds", "dattri_ds.layers", "dattri_ds.ops", "dattri_ds.store", "dattri_ds.eval",
              "dattri_ds.data", "dattri_ds.integrations", "dattri_ds.methods", "dattri_ds.models",
              "dattri_ds.selection", "dattri_ds.launch", "dattri_ds.tools"],
    package_dir={"dattri_ds.selection": "selection", "dattri_ds.launch": "launch",
                 "dattri_ds.tools": "tools"},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "hf": ["transformers>=4.40", "datasets", "sentencepiece", "protobuf", "accelerate",
               "trl>=1.16"],
        "deepspeed": ["deepspeed>=0.15"],
        "megatron": ["megatron-core>=0.12"],
        "plot": ["matplotlib"],
        "test": ["pytest", "transformers>=4.40"],
        # peer libraries for benchmarks/peers.py: install into a SEPARATE virtualenv with
        # torch pinned (pip install -c <constraints: torch==X> -e .[bench]); see its docstring
        "bench": ["dattri-llm==0.1.0", "dattri==0.3.0", "bergson==2.5.1", "kronfluence==1.0.1",
                  "transformers>=4.40", "datasets", "accelerate"],
    },
    entry_points={"console_scripts": ["dattri-ds=dattri_ds.tools.cli:main"]},
)
