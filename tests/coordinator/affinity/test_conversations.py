from coordinator.affinity.conversations import ConversationTable, continuation_key, conversation_key
from protocol.worker import CalledFunction, ChatMessage


def msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]  # type: ignore[arg-type]


TURN1 = msgs(("system", "Be brief."), ("user", "Hi"))
TURN2 = [*TURN1, *msgs(("assistant", "Hello!"), ("user", "How are you?"))]


def test_a_next_turn_finds_the_key_its_previous_turn_was_remembered_under() -> None:
    assert continuation_key("", "m", TURN2) == conversation_key("", "m", TURN1)
    assert continuation_key("", "m", TURN1) is None  # nothing to continue
    assert continuation_key("", "other", TURN2) != conversation_key("", "m", TURN1)  # per model
    assert continuation_key("k:b", "m", TURN2) != conversation_key("k:a", "m", TURN1)  # per tenant
    assert continuation_key("k:a", "m", TURN2) == conversation_key("k:a", "m", TURN1)


def test_the_results_of_a_turns_tool_calls_continue_it_as_a_user_turn_does() -> None:
    calls = ChatMessage(role="assistant", content="", tool_calls=(CalledFunction(name="f", arguments='{"a": 1}'),
                                                                  CalledFunction(name="g", arguments="{}")))
    results = [ChatMessage(role="tool", content="1", name="f"), ChatMessage(role="tool", content="2", name="g")]
    assert continuation_key("", "m", [*TURN1, calls, *results]) == conversation_key("", "m", TURN1)
    # Which calls were made is part of the conversation: the next turn after them is another key.
    other = calls.model_copy(update={"tool_calls": (CalledFunction(name="f", arguments='{"a": 2}'),)})
    assert conversation_key("", "m", [*TURN1, calls]) != conversation_key("", "m", [*TURN1, other])
    # The assistant's reply must be followed by what the client adds, and only that.
    assert continuation_key("", "m", [*TURN1, calls]) is None
    assert continuation_key("", "m", [*TURN1, calls, ChatMessage(role="system", content="x")]) is None


def test_keys_cannot_be_confused_by_moving_text_between_fields() -> None:
    a = conversation_key("", "m", msgs(("user", "ab"), ("user", "c")))
    b = conversation_key("", "m", msgs(("user", "a"), ("user", "bc")))
    c = conversation_key("", "m", msgs(("system", "ab"), ("user", "c")))
    assert len({a, b, c}) == 3


def test_the_table_is_bounded_and_forgets_the_least_recently_used() -> None:
    table = ConversationTable(2)
    for i in range(3):
        table.remember(bytes([i]), f"w{i}")
    assert len(table) == 2 and table.worker_of(b"\0") is None and table.worker_of(b"\2") == "w2"
    off = ConversationTable(0)
    off.remember(b"x", "w")
    assert len(off) == 0
