"""``python -m services.gateway``: run the gateway until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import asdict

from services.gateway.settings import SettingsError, add_gateway_args, settings_from


def build_parser() -> argparse.ArgumentParser:
    """The gateway's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="The pdserve gateway: gRPC Generate/GenerateStream and the OpenAI REST API over "
        "prefill and decode workers.",
    )
    add_gateway_args(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse flags, check them (exit 2 with a message when bad), and serve."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from(ns)
    except SettingsError as error:
        parser.error(str(error))  # exits 2

    from services.gateway.server import serve

    try:
        asyncio.run(serve(**asdict(settings)))
    except (ValueError, FileNotFoundError) as error:  # a bad setting or model directory
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. the port is taken
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
