"""Generated from protos/pdserve/v1 by ``python -m pdserve.wire.protogen``; do not edit."""
