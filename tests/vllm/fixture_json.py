"""JSON for the fixtures tests/vllm/ writes (golden.py, record_capture.py)."""


def jsonable(value):
    """A generic msgpack decode as JSON: bytes become {"$bytes_hex": ...}."""
    if isinstance(value, bytes):
        return {"$bytes_hex": value.hex()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value
