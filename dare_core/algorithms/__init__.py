"""Objectives: SFT, preference optimisation and the RL algorithms, one module each, registered by
name in the registry of their kind (algorithms/registry.py). Importing the package imports every
module in it, so a new algorithm is its own file (and recipe and test), with no list to extend."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
