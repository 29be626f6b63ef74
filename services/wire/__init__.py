"""The wire: conversions between pdserve's plain types and the protobuf messages of
``pdserve.v1`` (``convert``), and the generator of that package (``protogen``)."""
