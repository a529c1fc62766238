"""Operator tools over a store's persistent tiers, working on their storage directly:
`inventory` (what is stored: `kvtier inspect`) and `gc` (evict to a quota, by age or a whole
namespace: `kvtier gc`)."""
