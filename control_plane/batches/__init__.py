"""Batches of `/v1/batches`: an organisation's asynchronous jobs over a file of requests, a row
each (`Batch`) and a row per line of its input file (`BatchLine`: the request, then its
result). The gateway's `/v1/batches` creates, lists and cancels them through
`services.BatchService`; billing's batch runner (billing/batches.py) validates, runs and
finalizes them through the same service."""
