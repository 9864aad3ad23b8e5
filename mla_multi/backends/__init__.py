"""MLA backends: one module per backend, each imported only when the registry asks for it."""
