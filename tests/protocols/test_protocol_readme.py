"""`protocols/README.md` against the wire types: its version, its message lists, every type's fields
(name, type, default), the error codes and finish reasons, and the files it names.

The README is written by hand (its prose and meanings cannot be generated) and held to the types here:
a field added to a wire type, or to a record inside one, fails `test_each_type_table_matches_its_struct`
until the README documents it. A failure prints the rows the README should have.
"""

from __future__ import annotations

import typing

import msgspec
import pytest

from protocols.api import FinishReason
from protocols.errors import ErrorCode
from protocols.wire import PROTOCOL_VERSION, SUPPORTED_PROTOCOL_VERSIONS, ClientMessage, Hello, ServerMessage, StatsV1
from tests.support.config import REPO
from tests.support.protocol_readme import FieldDoc, ProtocolReadme, expected_fields, reachable_types

WIRE_TYPES = reachable_types(ClientMessage, ServerMessage)


@pytest.fixture(scope="module")
def readme() -> ProtocolReadme:
    return ProtocolReadme.load()


def _tags(union) -> list[str]:
    return [cls.__name__ for cls in typing.get_args(union)]


def _rows(fields: list[FieldDoc]) -> str:
    return "\n".join(f"| `{f.name}` | {f.type.replace('|', chr(92) + '|')} | {f.default} | |" for f in fields)


def test_the_readme_states_the_current_version(readme):
    assert readme.version == PROTOCOL_VERSION


def test_the_versions_section_lists_every_supported_version(readme):
    assert readme.versions == list(SUPPORTED_PROTOCOL_VERSIONS)


def test_the_message_lists_are_the_wire_unions(readme):
    assert sorted(readme.client_messages) == sorted(_tags(ClientMessage))
    assert sorted(readme.server_messages) == sorted(_tags(ServerMessage))


def test_every_wire_type_has_a_table_and_no_table_is_stale(readme):
    documented = {name for name, version in readme.types if version is None}
    assert documented == {cls.__name__ for cls in WIRE_TYPES}


@pytest.mark.parametrize("cls", WIRE_TYPES, ids=lambda cls: cls.__name__)
def test_each_type_table_matches_its_struct(readme, cls):
    expected = expected_fields(cls)
    assert readme.types[(cls.__name__, None)] == expected, f"protocols/README.md's `{cls.__name__}` table should read:\n{_rows(expected)}"


def test_the_version_1_stats_table_matches_what_a_version_1_connection_gets(readme):
    expected = expected_fields(StatsV1)
    assert readme.types[("Stats", 1)] == expected, f"the `Stats` (version 1) table should read:\n{_rows(expected)}"


def test_every_error_code_and_finish_reason_is_listed(readme):
    assert readme.error_codes == list(typing.get_args(ErrorCode))
    assert readme.finish_reasons == list(typing.get_args(FinishReason))


def test_every_file_the_readme_names_exists(readme):
    paths = readme.paths()
    assert "net/client.py" in paths and "protocols/wire.py" in paths
    assert not [path for path in paths if not (REPO / path).exists()]


def test_an_undocumented_field_fails_the_check(readme):
    class HelloWithAField(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="Hello"):  # Hello, plus a field
        protocol_version: int
        client: str = ""
        resume_token: str | None = None

    assert readme.types[("Hello", None)] == expected_fields(Hello)
    assert readme.types[("Hello", None)] != expected_fields(HelloWithAField)
