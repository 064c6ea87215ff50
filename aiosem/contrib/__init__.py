"""Optional integrations of aiosem with other libraries, each needing its extra.

Nothing here is imported by ``import aiosem``; import the module you use:

- `aiosem.contrib.fastapi` (``pip install 'aiosem[fastapi]'``): a FastAPI
  dependency that limits a route, answering 503 with ``Retry-After`` when
  no permit comes in time.
- `aiosem.contrib.aiohttp` (``pip install 'aiosem[aiohttp]'``): the same
  for aiohttp, as a handler decorator and as a middleware.
- `aiosem.contrib.opentelemetry` (``pip install 'aiosem[otel]'``): metrics
  and spans of waits, holds, grants, timeouts and losses.
"""
