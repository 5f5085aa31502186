"""Templated grade-school word problems from a seed: maths-style prompts to train on, written here rather than taken
from a benchmark (GSM8K stays held out)."""

from __future__ import annotations

import random

_NAMES = ["Ava", "Liam", "Maya", "Noah", "Zoe", "Omar", "Ines", "Kofi", "Lena", "Ravi", "Sofia", "Tariq", "Yuki",
          "Elena", "Marco", "Priya", "Jonas", "Amara", "Diego", "Hana", "Felix", "Nadia", "Owen", "Leila"]


_ITEMS = [("apples", "bag"), ("pencils", "box"), ("stickers", "sheet"), ("cookies", "tray"), ("marbles", "jar"),
          ("eggs", "carton"), ("books", "shelf"), ("cupcakes", "box"), ("stamps", "album page"), ("seeds", "packet"),
          ("bottles", "crate"), ("flowers", "bunch"), ("cards", "deck"), ("toy cars", "set"), ("oranges", "basket")]


_JOBS = [("walks dogs", "dog"), ("tutors students", "hour"), ("mows lawns", "lawn"), ("bakes cakes", "cake"),
         ("repairs bikes", "bike"), ("washes cars", "car"), ("paints fences", "fence"), ("sells lemonade", "cup")]


_UNITS = [("km", "hours", "km/h"), ("miles", "hours", "miles per hour"), ("meters", "seconds", "meters per second")]


def math_word_problems(n: int, seed: int) -> list[str]:
    """``n`` templated grade-school word problems from a seed (prompts only: they elicit the target's own step-by-step
    answers; written here, not taken from any benchmark)."""
    rng = random.Random(seed)
    out: list[str] = []

    def r(a: int, b: int) -> int:
        return rng.randint(a, b)

    def templates() -> str:
        a, b = rng.sample(_NAMES, 2)
        item, cont = rng.choice(_ITEMS)
        job, unit = rng.choice(_JOBS)
        dist, time_, speed = rng.choice(_UNITS)
        k = r(0, 19)
        if k == 0:
            return (f"{a} has {r(5, 60)} {item}. {a} buys {r(2, 9)} {cont}s with {r(3, 12)} {item} in each "
                    f"{cont}, then gives {r(2, 20)} {item} to {b}. How many {item} does {a} have now?")
        if k == 1:
            return (f"{a} {job} and earns ${r(5, 40)} per {unit}. This week {a} worked {r(3, 25)} {unit}s and spent "
                    f"${r(10, 90)} on supplies. How much money did {a} make after expenses?")
        if k == 2:
            return (f"A car travels {r(40, 400)} {dist} in {r(2, 8)} {time_}. At the same speed, how far does it "
                    f"travel in {r(3, 12)} {time_}?")
        if k == 3:
            return (f"{a} is {r(6, 40)} years old. {b} is {r(2, 5)} times as old as {a}. How old will {b} be in "
                    f"{r(2, 15)} years?")
        if k == 4:
            return (f"A shirt costs ${r(12, 80)}. It is on sale for {rng.choice([10, 15, 20, 25, 30, 40, 50])}% off. "
                    f"{a} buys {r(2, 6)} shirts. How much does {a} pay?")
        if k == 5:
            return (f"{a} reads {r(8, 40)} pages every day. The book has {r(150, 600)} pages. After {r(3, 9)} days, "
                    f"how many pages are left to read?")
        if k == 6:
            return (f"There are {r(3, 12)} {cont}s of {item}. Each {cont} holds {r(6, 24)} {item}. {a} and {b} share "
                    f"them equally. How many {item} does each person get?")
        if k == 7:
            return (f"A rectangle is {r(3, 40)} meters long and {r(2, 30)} meters wide. What is its area and its "
                    f"perimeter?")
        if k == 8:
            return (f"{a} saves ${r(5, 50)} every week. {a} wants to buy a bike that costs ${r(120, 900)} and already "
                    f"has ${r(10, 100)}. How many weeks will it take to save enough?")
        if k == 9:
            return (f"A bakery sells {r(20, 200)} muffins in the morning and {r(2, 4)} times as many in the "
                    f"afternoon. Each muffin costs ${r(2, 5)}. How much money did the bakery make that day?")
        if k == 10:
            return (f"{a} has {r(20, 100)} dollars. {a} spends a quarter of it on lunch and {r(3, 10)} dollars on a "
                    f"book. How much money is left?")
        if k == 11:
            return (f"A class has {r(18, 36)} students. {rng.choice([25, 40, 50, 60, 75])}% of them are girls. How "
                    f"many boys are in the class?")
        if k == 12:
            return (f"{a} runs {r(2, 9)} laps around a {r(200, 800)} meter track every morning for {r(3, 7)} days. "
                    f"How many kilometers does {a} run in total?")
        if k == 13:
            return (f"A farmer has {r(5, 40)} cows and {r(5, 60)} chickens. How many legs do the animals have in "
                    f"total?")
        if k == 14:
            return (f"{a} bought {r(2, 9)} notebooks for ${r(2, 7)} each and {r(2, 6)} pens for ${r(1, 3)} each. "
                    f"{a} paid with a ${rng.choice([20, 50, 100])} bill. How much change did {a} get?")
        if k == 15:
            return (f"A tank holds {r(100, 900)} liters of water. It leaks {r(2, 15)} liters per hour. How many "
                    f"liters are left after {r(3, 24)} hours?")
        if k == 16:
            return (f"{a} is twice as old as {b}. The sum of their ages is {3 * r(5, 30)}. How old is {b}?")
        if k == 17:
            return (f"A pizza is cut into {rng.choice([6, 8, 10, 12])} slices. {a} eats {r(1, 3)} slices and {b} "
                    f"eats {r(1, 4)} slices. What fraction of the pizza is left?")
        if k == 18:
            return (f"Solve step by step: {r(12, 999)} {rng.choice(['+', '-', '*'])} {r(2, 99)} "
                    f"{rng.choice(['+', '-', '*'])} {r(2, 99)}")
        plant = rng.choice(["tomato plants", "sunflowers", "carrots", "bean plants", "tulips", "lettuces"])
        return (f"{a} plants {r(3, 12)} rows of {plant} with {r(4, 20)} in each row. {r(2, 15)} of them do not grow. "
                f"How many grow?")

    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < 20 * n:
        tries += 1
        q = templates()
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out
