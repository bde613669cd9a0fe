"""A model's state at rest: tensor streams and manifests, checkpoints, merged models.

Pure arithmetic and files (safetensors and JSON, written atomically), on
local paths or on a store fsspec serves (``storage``: s3://, gs://, ...);
no gossip networking. Nothing here unpickles or ``torch.load``s anything.
"""
