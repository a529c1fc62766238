"""The tiers that keep one file a chunk in a directory: `disk` (a local directory this engine
alone writes, indexed in memory) and `shared` (a directory many engines and nodes write, its
quota kept together), over the same tree (`filetree`, `chunkfiles`, `chunktree`, `fsops`) and
manifest (`manifests`). A disk tier's directory is owned by one open tier at a time (`owner`).
"""
