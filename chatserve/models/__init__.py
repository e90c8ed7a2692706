"""Model architectures, the registry that names them, and weight loaders."""
