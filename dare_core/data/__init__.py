"""Data: synthetic tasks, user files, schemas and the prepare step that writes the training splits."""
