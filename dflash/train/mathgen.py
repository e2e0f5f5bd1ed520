"""Templated math and word problems with random numbers: `math_prompt(rng)` draws one.

Each generator below writes one kind of problem (arithmetic stories, percentages, rates, equations,
geometry, probability, sequences, number theory, unit conversions...) from corpus.py's word lists;
`math_prompt` picks a generator and an instruction (how to answer). Only the prompt is written: the
target answers it when the training data is regenerated.
"""

from __future__ import annotations

import random
from typing import Callable

from dflash.train.corpus import ITEMS, NAMES, PLACES

INSTRUCTIONS = [
    "Work it out step by step.",
    "Show each step of your reasoning.",
    "Explain your reasoning, then give the final answer.",
    "Solve it step by step and state the answer clearly at the end.",
    "Give a short explanation and the final answer.",
    "Think it through step by step, then write the final answer as \\boxed{answer}.",
    "Show the calculation and box the final result with \\boxed{}.",
    "Answer with a clear, numbered list of steps.",
    "",
]

JOBS = ["painter", "gardener", "baker", "mechanic", "tutor", "cleaner", "plumber"]
VEHICLES = ["car", "bus", "cyclist", "train", "truck", "boat"]
SHAPES_3D = [("cube", "side"), ("box", "edges")]


def _story(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    x, y, z = r.randint(5, 300), r.randint(2, 90), r.randint(2, 40)
    item = r.choice(ITEMS)
    return r.choice(
        [
            f"{a} collected {x} {item}. On the way home {a} lost {z} of them, and then {b} gave {a} {y} more. How many "
            f"{item} does {a} have now?",
            f"{a} had {x} {item} and sold {z} of them at the {r.choice(PLACES)} each day for {r.randint(2, 6)} days. "
            f"How many are left?",
            f"{a} has {y} boxes with {z} {item} in each box. {b} "
            f"has {x} {item}. How many {item} do they have together?",
            f"{a} shares {x} {item} equally among {z} bags and keeps the rest. How many go into each bag and how many "
            f"does {a} keep?",
            f"Each of {z} students brings {y} {item} to class. The teacher adds {x} more. How many {item} are there in "
            f"total?",
        ]
    )


def _percent(r: random.Random) -> str:
    a = r.choice(NAMES)
    x, p, q = r.randint(20, 900), r.choice([5, 10, 12, 15, 20, 25, 30, 35, 40, 50, 60, 75]), r.choice([5, 10, 20, 25])
    return r.choice(
        [
            f"A jacket costs ${x}. It is on sale for {p}% off, and then a further {q}% is taken off the sale price. "
            f"What is the final price?",
            f"{a}'s salary of ${x * 10} a month rises by {p}%. What is the new monthly salary, and how much more is "
            f"that per year?",
            f"A town had {x * 10} residents. The population grew by "
            f"{p}% in one year. How many residents are there now?",
            f"{a} scored {min(x, 99)} out of 100 on a test and {p} out of 80 on another. Which score is the higher "
            f"percentage?",
            f"What is {p}% of {x}? And what percent of {x} is {q * 3}?",
            f"A shop buys an item for ${x} and sells it at a {p}% profit. What is the selling price and the profit?",
        ]
    )


def _rate(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    v, t, d = r.randint(20, 120), r.randint(2, 9), r.randint(50, 900)
    return r.choice(
        [
            f"A {r.choice(VEHICLES)} travels {d} km at {v} km/h. How long does the trip take, in hours and minutes?",
            f"{a} can paint a fence in {t} hours and {b} can paint it in {t + r.randint(1, 6)} hours. How long do they "
            f"take working together?",
            f"Two trains leave stations {d} km apart at the same time, heading toward each other at {v} km/h and "
            f"{v + 15} km/h. When do they meet?",
            f"A pump fills {v} litres per minute and a leak loses {r.randint(1, 19)} litres per minute. "
            f"How long does it take to fill a {d * 10}-litre tank?",
            f"A {r.choice(JOBS)} earns ${v} per hour and works {t} hours a day, {r.randint(3, 6)} days a week. How "
            f"much is that in 4 weeks?",
            f"{a} walks {t} km in {v} minutes. At the same pace, how far does {a} walk in {v * 3} minutes?",
        ]
    )


def _equation(r: random.Random) -> str:
    a, b, c = r.randint(2, 12), r.randint(-30, 30), r.randint(-50, 80)
    d, e = r.randint(1, 9), r.randint(1, 9)
    return r.choice(
        [
            f"Solve for x: {a}x + {b} = {c}.",
            f"Solve the system of equations: {a}x + {d}y = {c} and {e}x - y = {b}.",
            f"Find the roots of x^2 - {d + e}x + {d * e} = 0.",
            f"For which values of x is {a}x - {abs(b)} greater than {c}?",
            f"Simplify ({a}x + {d})({a}x - {d}) and expand the result.",
            f"If f(x) = {a}x^2 - {d}x + {e}, compute f({r.randint(-5, 6)}) and f'(x).",
            f"The sum of two numbers is {c + 100} and their difference is {abs(b) + 2}. Find the two numbers.",
        ]
    )


def _geometry(r: random.Random) -> str:
    x, y, z = r.randint(2, 40), r.randint(2, 40), r.randint(2, 20)
    return r.choice(
        [
            f"A rectangle is {x} m long and {y} m wide. What are its area, its perimeter and the length of its "
            f"diagonal?",
            f"A circle has a radius of {z} cm. Find its circumference and its area, using pi = 3.14.",
            f"A right triangle has legs of {x} and {y}. How long is the hypotenuse?",
            f"A cube has a side of {z} cm. What are its volume and its surface area?",
            f"A cylinder has radius {z} cm and height {x} cm. What is its volume?",
            f"The angles of a triangle are in the ratio {z}:{x}:{y}. What is each angle?",
            f"A garden {x} m by {y} m has a path {r.randint(1, 3)} m wide all around it, outside the garden. What is "
            f"the area of the path?",
        ]
    )


def _probability(r: random.Random) -> str:
    red, blue, green = r.randint(1, 12), r.randint(1, 12), r.randint(1, 12)
    n = r.randint(2, 6)
    return r.choice(
        [
            f"A bag holds {red} red, {blue} blue and {green} green marbles. What is the probability of drawing a blue "
            f"one? "
            "And two red ones in a row without replacement?",
            f"Two fair dice are rolled. What is the probability that the sum is {r.randint(2, 12)}?",
            f"A fair coin is tossed {n + 2} times. What is the probability of exactly {n} heads?",
            f"In how many ways can {n + 3} people sit in a row? In "
            f"how many ways can a team of {n} be chosen from them?",
            f"How many {n}-letter codes can be made from the letters A to {chr(64 + n + 4)} if letters may not repeat?",
        ]
    )


def _numbers(r: random.Random) -> str:
    a, b = r.randint(12, 400), r.randint(12, 400)
    n, k = r.randint(5, 30), r.randint(2, 9)
    return r.choice(
        [
            f"Find the greatest common divisor and the least common multiple of {a} and {b}.",
            f"Is {a * 2 + 1} a prime number? Explain how you check.",
            f"What is the remainder when {a * b} is divided by {k}?",
            f"An arithmetic sequence starts {k}, {k + n}, {k + 2 * n}, ... What is its {n}th term, and the sum of its "
            f"first {n} terms?",
            f"A geometric sequence starts {k}, {k * 2}, {k * 4}, ... What is its {min(n, 12)}th term?",
            f"Write {a} in binary and in hexadecimal, and explain the conversion.",
            f"What is {a} x {b} - {n * k}? Then divide the result by {k}.",
            f"Compute {a / 8:.2f} + {b / 4:.2f} and round the result to one decimal place.",
            f"Add the fractions {k}/{n} and {n % 7 + 1}/{k + 1}, and simplify the result.",
        ]
    )


def _units(r: random.Random) -> str:
    x = r.randint(2, 500)
    return r.choice(
        [
            f"Convert {x} degrees Fahrenheit to Celsius.",
            f"How many seconds are there in {x % 30 + 1} days and {x % 24} hours?",
            f"A recipe for {r.randint(2, 6)} people needs {x} grams of flour. How much is needed for "
            f"{r.randint(7, 20)} people?",
            f"Convert {x} km/h into metres per second.",
            f"A map has a scale of 1:{x * 100}. Two towns are {r.randint(2, 30)} cm apart on the map. How far apart "
            f"are they really, in km?",
        ]
    )


def _money(r: random.Random) -> str:
    a = r.choice(NAMES)
    p, rate, years = r.randint(200, 9000), r.choice([2, 3, 4, 5, 6, 8]), r.randint(2, 10)
    return r.choice(
        [
            f"{a} invests ${p} at {rate}% simple interest per year. How much interest is earned after {years} years?",
            f"${p} is put in a savings account at {rate}% interest compounded yearly. What is the balance after "
            f"{years} years?",
            f"{a} buys {years} notebooks at ${rate}.50 each and a bag for ${p % 90 + 10}. How much change from "
            f"${p % 90 + 100}?",
            f"A phone plan costs ${rate * 5} a month plus ${rate / 10:.2f} per minute. {a} talks {p % 600} minutes. "
            f"What is the bill?",
        ]
    )


def _ages(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    x, k, y = r.randint(3, 40), r.randint(2, 5), r.randint(2, 15)
    return r.choice(
        [
            f"{a} is {k} times as old as {b}. In {y} years {a} will be twice as old as {b}. How old are they now?",
            f"The average age of {k + 3} friends is {x}. One more friend aged {x + y} joins. What is the new average?",
            f"{a} is {y} years older than {b}. The sum of their ages is {2 * x + y}. How old is each?",
        ]
    )


GENERATORS: list[Callable[[random.Random], str]] = [
    _story,
    _percent,
    _rate,
    _equation,
    _geometry,
    _probability,
    _numbers,
    _units,
    _money,
    _ages,
]


def math_prompt(rng: random.Random) -> str:
    """One math or word problem with an instruction on how to answer."""
    q = rng.choice(GENERATORS)(rng)
    ins = rng.choice(INSTRUCTIONS)
    return f"{q} {ins}".strip() if ins else q
