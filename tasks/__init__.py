"""Prefect tasks: one per pipeline stage, each running its DVC stage (`tasks.dvc_stage`).

Importing this package does not import Prefect; import `tasks.dvc_stage` for the task.
"""
