"""Placeholder until the runs API lands (issue 4)."""
from aiohttp import web


def routes(app: web.Application) -> None:
    return None
