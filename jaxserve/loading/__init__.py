"""Model loading: one format dispatch (dummy, orbax, HF safetensors, GGUF) for one device or a
tensor-parallel mesh, and the paths of the models shipped as Python packages."""
