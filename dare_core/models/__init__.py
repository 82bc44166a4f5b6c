"""Model families over one shared transformer. Importing the package imports every module in it,
which registers every family: a new family is its own file (and test fixture), with no list to extend."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
