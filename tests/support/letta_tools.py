"""Tools shaped like the ones in Letta's own sandbox tests, sync and async (sent as source)."""

# ruff: noqa: F821, UP037, SIM112
# (client and the typing names exist in the sandbox's scope; annotations stay quoted because
# the kernel evaluates them; Letta's tests read a lower-case variable)

from __future__ import annotations


def add(x: int, y: int) -> int:
    """Simple function that adds two integers.

    Parameters:
        x (int): The first integer to add.
        y (int): The second integer to add.

    Returns:
        int: The result of adding x and y.
    """
    return x + y


async def async_add(x: int, y: int) -> int:
    """Async function that adds two integers.

    Parameters:
        x (int): The first integer to add.
        y (int): The second integer to add.
    """
    import asyncio

    await asyncio.sleep(0.1)
    return x + y


def get_env() -> str:
    """Return the secret word env variable."""
    import os

    secret_word = os.getenv("secret_word")
    print(secret_word)
    return secret_word


async def async_get_env() -> str:
    """Async: return the secret word env variable."""
    import asyncio
    import os

    await asyncio.sleep(0.01)
    secret_word = os.getenv("secret_word")
    print(secret_word)
    return secret_word


def letta_ids() -> dict:
    """The ids Letta puts in the environment."""
    import os

    return {k: os.getenv(k) for k in ("LETTA_AGENT_ID", "LETTA_PROJECT_ID", "LETTA_TOOL_ID")}


def error() -> str:
    """Simple function that errors."""
    print("Going to error now")
    raise ZeroDivisionError("This is an intentionally weird division!")


async def async_error() -> str:
    """Async function that errors."""
    import asyncio

    await asyncio.sleep(0.01)
    print("Going to error now")
    raise ValueError("This is an intentional async error!")


def create_list():
    """Simple function that returns a list."""
    return [1] * 5


async def async_create_list() -> list:
    """Async function that returns a list."""
    import asyncio

    await asyncio.sleep(0.01)
    return [1, 2, 3, 4, 5]


async def async_complex_computation(iterations: int = 3) -> dict:
    """Async computation with several awaits.

    Parameters:
        iterations (int): Number of iterations to perform.
    """
    import asyncio
    import time

    results = []
    start_time = time.time()
    for i in range(iterations):
        await asyncio.sleep(0.1)
        results.append(i * 2)
    return {
        "results": results,
        "duration": time.time() - start_time,
        "iterations": iterations,
        "average": sum(results) / len(results) if results else 0,
    }


def clear_memory(agent_state: "AgentState"):
    """Clear the core memory."""
    agent_state.memory.get_block("human").value = ""
    agent_state.memory.get_block("persona").value = ""


async def async_clear_memory(agent_state: "AgentState"):
    """Async function that clears the core memory."""
    import asyncio

    await asyncio.sleep(0.01)
    agent_state.memory.get_block("human").value = ""
    agent_state.memory.get_block("persona").value = ""


def core_memory_replace(
    agent_state: "AgentState", label: str, old_content: str, new_content: str
) -> Optional[str]:
    """Replace the contents of core memory (Letta's base tool, typing names from its scope).

    Args:
        label (str): Section of the memory to be edited.
        old_content (str): String to replace. Must be an exact match.
        new_content (str): Content to write to the memory.
    """
    current_value = str(agent_state.memory.get_block(label).value)
    if old_content not in current_value:
        raise ValueError(f"Old content '{old_content}' not found in memory block '{label}'")
    new_value = current_value.replace(str(old_content), str(new_content))
    agent_state.memory.update_block_value(label=label, value=new_value)
    return new_value


def warn_hello_world() -> str:
    """Warn hello world."""
    import warnings

    msg = "Hello World"
    warnings.warn(msg, stacklevel=1)
    return msg


def convert_values() -> dict:
    """Values JSON cannot hold, converted as Letta converts them."""
    import datetime

    return {
        "when": datetime.datetime(2024, 1, 2, 3, 4, 5),
        "set": {1, 2, 3},
        "bytes": b"abc",
        "tuple": (1, 2),
    }


def typed_args(count: int, ratio: float, flag: bool, items: List[int], opts: dict) -> dict:
    """Arguments as Letta coerces them (``List`` from ``from typing import *``).

    Args:
        count: An integer.
        ratio: A float.
        flag: A boolean.
        items: Integers.
        opts: Options.
    """
    return {"count": count, "ratio": ratio, "flag": flag, "items": items, "opts": opts}


def who_am_i(agent_id: str) -> dict:
    """The injected agent id and the client in scope."""
    return {"agent_id": agent_id, "client_is_none": client is None}


def count_calls() -> int:
    """A counter kept in the kernel between runs (state persists)."""
    global _calls
    try:
        _calls += 1
    except NameError:
        _calls = 1
    return _calls


def slow(seconds: int) -> str:
    """Sleep, after setting a variable that must survive the interrupt.

    Args:
        seconds: How long to sleep.
    """
    import time

    global survived
    survived = "yes"
    time.sleep(seconds)
    return "done"


async def async_slow(seconds: int) -> str:
    """Async sleep, after setting a variable that must survive the interrupt.

    Args:
        seconds: How long to sleep.
    """
    import asyncio

    global survived_async
    survived_async = "yes"
    await asyncio.sleep(seconds)
    return "done"


def read_survivors() -> list:
    """What the slow tools left in the kernel."""
    return [globals().get("survived"), globals().get("survived_async")]


def read_codebase() -> dict:
    """Import a module from the sandbox directory (an external codebase)."""
    import os

    from helpers import GREETING

    return {"cwd": os.getcwd(), "greeting": GREETING}


def adjust_menu_prices(percentage: float) -> str:
    """Adjust the prices of all menu items by a percentage (Letta's external-codebase tool).

    Args:
        percentage: The percentage by which to adjust prices.
    """
    import kxcow
    from core.menu import Menu, MenuItem
    from core.utils import format_currency
    from kxtqdm import tqdm

    if not isinstance(percentage, (int, float)):
        raise TypeError("percentage must be a number")
    menu = Menu()
    menu.add_item(MenuItem("Burger", 8.99, "Main"))
    menu.add_item(MenuItem("Fries", 2.99, "Side"))
    menu.add_item(MenuItem("Soda", 1.99, "Drink"))
    adjustments = []
    for item in tqdm(menu.items):
        old_price = item.price
        item.price += item.price * (percentage / 100)
        adjustments.append(
            f"{item.name}: {format_currency(old_price)} -> {format_currency(item.price)}"
        )
    kxcow.cow("Hello World")
    return "Price Adjustments:\n" + "\n".join(adjustments)


def venv_marker() -> str:
    """Which build of this venv runs (its ``pyvenv.cfg``'s inode and time: a rebuilt venv has
    a new one) and where it is, as text: a venv without pydantic gets Letta's ``str()``
    conversion of any other value. Read only: a kernel with a user of its own may not write
    into a venv, which other tenants' kernels share."""
    import os
    import sys

    st = os.stat(os.path.join(sys.prefix, "pyvenv.cfg"))
    return f"{st.st_ino}:{st.st_mtime_ns} {sys.prefix}"


def use_broken_package() -> str:
    """Needs a package that cannot be installed."""
    import kxbroken

    return kxbroken.__name__


def wait_for_ever(marker: str) -> None:
    """Say it started (into the FIFO ``marker``), then sleep until stopped.

    Args:
        marker: A named pipe the test reads.
    """
    import time

    with open(marker, "w") as fifo:
        fifo.write("started")
    time.sleep(3600)


def where_am_i() -> str:
    """The working directory."""
    import os

    return os.getcwd()


def upper_block(label: str, agent_state: "AgentState") -> str:
    """Upper-case a memory block through the agent state's own methods.

    Args:
        label: The block's label.
    """
    agent_state.set_block(label, agent_state.get_block(label).upper())
    return agent_state.get_block(label)


def not_a_number() -> list:
    """Return what JSON spells NaN and Infinity."""
    return [float("nan"), float("inf"), -float("inf"), 1.5]


def write_here(name: str, text: str) -> str:
    """Write ``text`` to the file ``name`` in the working directory (its sandbox_dir) and
    append it to ``helpers.py``; say who owns what it wrote.

    Args:
        name: A file name.
        text: What to write.
    """
    import os

    with open(name, "w") as fh:
        fh.write(text)
    with open("helpers.py", "a") as fh:
        fh.write(f"# {text}\n")
    return f"{os.stat(name).st_uid == os.getuid()}"


def read_here(name: str) -> list:
    """The file ``name`` and ``helpers.py`` in the working directory, None for one missing.

    Args:
        name: A file name.
    """
    import os

    return [open(n).read() if os.path.exists(n) else None for n in (name, "helpers.py")]
