"""The s3 tier (an S3-compatible bucket, one object a chunk): `tier` (S3Tier), its config,
client (boto3, imported lazily), lookups and inventory.
"""
