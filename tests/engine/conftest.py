import pytest


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Each engine test that takes it runs with asynchronous scheduling off and on."""
    return request.param
