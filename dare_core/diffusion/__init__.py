"""The masked-diffusion math every objective shares: masking laws, ELBO estimates, block layouts, seeds."""
