"""dattri-ds: training data attribution and online data selection inside DeepSpeed/Megatron."""

from setuptools import find_packages, setup

#: the design card's top-level folders, installed under our namespace (a top-level
#: ``selection`` package already exists on the package index)
MAPPED = {"dattri_ds.selection": "selection", "dattri_ds.launch": "launch",
          "dattri_ds.tools": "tools"}


def _packages() -> list[str]:
    """Every package, found (never listed): dattri_ds and each mapped folder's subpackages."""
    found = find_packages(include=["dattri_ds", "dattri_ds.*"])
    for name, folder in MAPPED.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return sorted(found)


setup(
    name="dattri-ds",
    version="0.1.0",
    description="Per-example gradients, training data attribution and online data selection "
                "for DeepSpeed ZeRO and Megatron-core training",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=_packages(),
    package_dir=MAPPED,
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "hf": ["transformers>=4.40", "datasets", "pyarrow", "sentencepiece", "protobuf",
               "accelerate", "trl>=1.16"],
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
