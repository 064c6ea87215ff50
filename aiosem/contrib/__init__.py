"""Optional integrations of aiosem with other libraries, each needing its extra.

Nothing here is imported by ``import aiosem``; import the module you use:

- `aiosem.contrib.fastapi` (aiosem's ``fastapi`` extra): a FastAPI
  dependency that limits a route, answering 503 with ``Retry-After`` when
  no permit comes in time.
- `aiosem.contrib.aiohttp` (aiosem's ``aiohttp`` extra): the same
  for aiohttp, as a handler decorator and as a middleware.
- `aiosem.contrib.opentelemetry` (aiosem's ``otel`` extra): metrics
  and spans of waits, holds, grants, timeouts and losses.
"""
