"""Model families over one shared transformer; importing the package registers every family."""
from dare_core.models import dream, llada, llada2, sdar  # noqa: F401  (registration)
