"""Placeholder until the supervisor lands (issue 4)."""


async def supervisor_task(app, settings) -> None:
    return None
