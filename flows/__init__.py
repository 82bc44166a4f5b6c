"""Prefect flows: the DARE pipeline's orchestration layer (thin; no ML logic).

`flows.pipeline.dare_pipeline` runs the DVC stages in order as Prefect tasks; `python -m
flows.pipeline --help` for the command line. Importing this package does not import Prefect.
"""
