"""A request handler that answers "busy" rather than queue behind a slow backend.

Every request needs the backend, which takes three requests at a time across
all the server's processes. A handler waits at most 50 ms for its turn; after
that it answers 503 at once instead of piling up. The server is plain
asyncio (no web framework needed); the example starts it, sends it ten
requests at once, prints the answers and stops::

    python examples/handler.py                            # memory:// (aiosem's memory extra)
    python examples/handler.py redis://localhost:6379/0
"""

from __future__ import annotations

import asyncio
import sys

import anyio

import aiosem

backend = aiosem.limiter("backend", 3, blocking_timeout=0.05)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    request = (await reader.readline()).decode().strip()
    try:
        async with backend as permit:
            await anyio.sleep(1.0)  # the backend's work, simulated: far longer than the 50 ms anyone waits
            answer = f"200 {request} done under fencing token {permit.fencing_token}"
    except aiosem.AcquireTimeout:
        answer = f"503 {request}: busy, try again later"
    writer.write(answer.encode() + b"\n")
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def request(port: int, number: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"request-{number}\n".encode())
    await writer.drain()
    answer = (await reader.readline()).decode().strip()
    writer.close()
    await writer.wait_closed()
    return answer


async def main(url: str) -> None:
    aiosem.configure(url=url)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for answer in await asyncio.gather(*(request(port, number) for number in range(10))):
            print(answer)
    finally:
        server.close()
        await server.wait_closed()
        await aiosem.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "memory://"))
