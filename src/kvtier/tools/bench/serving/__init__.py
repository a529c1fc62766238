"""The serving harness: workloads sent to any OpenAI-compatible endpoint and what they measured
(`client` streams requests, `workloads` and `arrivals` make them, `runner` runs one benchmark of
one endpoint between two scrapes of its metrics, `promdiff` reads those, `stats` and `report`
sum them up). The `kvtier bench` commands that drive servers are built on it.
"""
