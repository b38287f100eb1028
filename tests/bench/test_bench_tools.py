"""`zhuzi bench tools`: BFCL's cases reach the servers as its OpenAI handler sends them, bfcl-eval's own checker
scores the calls that come back, and every failure is sorted into the server's or the model's."""
import pytest

from zhuzi.bench import tools

checker, DATA = tools.bfcl()


def case(category: str, index: int) -> tools.Case:
    return tools.load_cases(DATA, category, 0)[index]


def call(name: str, arguments: str) -> dict:
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_limit_takes_the_same_spread_cases_every_time():
    chosen = tools.load_cases(DATA, "parallel", 4)
    assert [c.id for c in chosen] == ["parallel_0", "parallel_50", "parallel_100", "parallel_150"]
    assert all(c.answer for c in chosen) and tools.load_cases(DATA, "irrelevance", 2)[0].answer is None


def test_functions_become_openai_tools_with_json_schema_types_and_no_dots():
    functions = [{"name": "math.hypot", "description": "d", "parameters": {"type": "dict", "properties": {
        "x": {"type": "float"}, "points": {"type": "tuple", "items": {"type": "dict", "properties": {
            "y": {"type": "any"}}}}}, "required": ["x"]}}]
    tool = tools.openai_tools(functions)[0]["function"]
    assert tool["name"] == "math_hypot" and tool["parameters"]["type"] == "object"
    points = tool["parameters"]["properties"]["points"]
    assert (tool["parameters"]["properties"]["x"]["type"], points["type"]) == ("number", "array")
    assert points["items"] == {"type": "object", "properties": {"y": {"type": "string"}}}
    assert functions[0]["name"] == "math.hypot"  # the checker's reference is left as BFCL wrote it


def test_the_checker_takes_a_right_call_and_names_a_wrong_one_the_models():
    triangle = case("simple", 0)  # calculate_triangle_area(base=10, height=5)
    right = {"content": None, "tool_calls": [call("calculate_triangle_area", '{"base": 10, "height": 5}')]}
    assert tools.score(checker, triangle, 200, right) is None
    wrong = {"content": None, "tool_calls": [call("calculate_triangle_area", '{"base": 11, "height": 5}')]}
    failure = tools.score(checker, triangle, 200, wrong)
    assert failure.kind == "model" and "base" in failure.why
    dotted = case("simple", 1)  # math.factorial(number=5), called as math_factorial
    assert tools.score(checker, dotted, 200, {"tool_calls": [call("math_factorial", '{"number": 5}')]}) is None
    assert tools.score(checker, triangle, 200, {"content": "The area is 25."}).kind == "model"


@pytest.mark.parametrize(("status", "reply", "why"), [
    (500, "Internal Server Error", "HTTP 500"),
    (200, {"tool_calls": [call("calculate_triangle_area", '{"base": 10,')]}, "arguments are not JSON"),
    (200, {"tool_calls": [call("calculate_triangle_area", "[10, 5]")]}, "arguments are not an object"),
    (200, {"content": '```json\n{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}\n```'},
     "a call left in content"),
    (200, {"content": '<tool_call>\n{"name": "calculate_triangle_area", "arguments": {}}\n</tool_call>'},
     "a call left in content"),
])
def test_what_the_server_got_wrong_is_a_server_error(status, reply, why):
    failure = tools.score(checker, case("simple", 0), status, reply)
    assert (failure.kind, failure.why) == ("server", why)


def test_irrelevance_is_right_only_without_a_call():
    unrelated = case("irrelevance", 0)
    assert tools.score(checker, unrelated, 200, {"content": "I cannot help with that using these tools."}) is None
    name = unrelated.functions[0]["name"].replace(".", "_")
    assert tools.score(checker, unrelated, 200, {"tool_calls": [call(name, "{}")]}).kind == "model"


@pytest.mark.parametrize("text", ["The area is 25 square units.", '{"area": 25}', "```python\nprint(25)\n```"])
def test_prose_and_plain_json_are_not_taken_for_calls(text):
    assert not tools.leaked_call(text)
