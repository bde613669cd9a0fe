"""A model's state at rest: tensor streams and manifests, checkpoints, merged models.

Pure arithmetic and local files (safetensors and JSON, written atomically);
no networking. Nothing here unpickles or ``torch.load``s anything.
"""
