"""What the training prompts are built from: word lists and templates (train_prompts.py fills them).

- `STDLIB_MODULES`: the standard-library modules whose public functions and classes become coding
  tasks (signatures, first docstring sentences, short sources, read with `inspect`);
- `CODE_TEMPLATES`, `CLASS_TEMPLATES`, `SOURCE_TEMPLATES`: tasks about one of those objects;
- `GENERAL_TASKS` with `GENERAL_TEMPLATES` / `CLASS_GENERAL_TEMPLATES`: general coding exercises
  written for this project;
- `NAMES`, `ITEMS`, `PLACES`, `ARITH_TEMPLATES`: templated arithmetic word problems.
"""

STDLIB_MODULES = [
    "textwrap", "string", "collections", "itertools", "functools", "heapq", "bisect", "statistics",
    "json", "csv", "re", "posixpath", "shutil", "pathlib", "fnmatch", "glob", "difflib", "html",
    "urllib.parse", "base64", "calendar", "datetime", "fractions", "decimal", "random", "operator",
    "copy", "pprint", "reprlib", "enum", "dataclasses", "contextlib", "ast", "argparse", "logging",
    "zipfile", "tarfile", "gzip", "tempfile", "uuid", "ipaddress", "email.utils", "queue",
    "threading", "sched", "secrets", "shlex", "configparser", "mimetypes", "colorsys", "graphlib",
    "numbers", "weakref", "types", "timeit", "platform", "pickle", "shelve", "locale", "getopt",
    "codecs", "plistlib", "xml.etree.ElementTree", "html.parser", "http.cookies", "wave", "filecmp",
    "linecache", "tokenize", "keyword", "quopri", "uu", "zipapp", "selectors", "socketserver",
    "unittest", "doctest", "traceback", "warnings", "abc", "inspect", "typing", "cmd", "code",
    "pydoc", "optparse", "netrc", "smtplib", "ftplib", "poplib", "imaplib", "http.client",
    "urllib.request", "mailbox", "sqlite3", "dbm", "zlib", "bz2", "lzma", "hmac", "hashlib", "math",
    "cmath", "array", "struct", "io", "os", "sys", "time", "stat", "glob", "string",
]

CODE_TEMPLATES = [
    "Write a Python function `{name}{sig}` that does the following: {summary} Keep it simple and add a docstring.",
    "The standard library offers `{qual}`. Describe when you would use it, then write a small program that uses it.",
    "Implement your own simplified version of `{qual}` in pure Python. Its documentation says: \"{summary}\"",
    "Show with a short example how to call `{qual}` and print the result. Comment every line.",
    "Write unit tests with the unittest module for `{qual}`. Cover a normal case and an edge case.",
    "What are the arguments of `{qual}{sig}`? Explain each one briefly and give an example call.",
]
CLASS_TEMPLATES = [
    "Explain the purpose of the class `{qual}` from the Python standard library and write an example that creates one.",
    "Write a Python class named `My{name}` that behaves like a much simpler `{qual}`. Its documentation says: \"{summary}\"",
    "Give a short tutorial on `{qual}`: how to create it and use its most common methods.",
]
SOURCE_TEMPLATES = [
    "Read this function from the Python standard library and explain what it does, step by step:\n\n```python\n{src}```",
    "Add type hints and a clearer docstring to this function:\n\n```python\n{src}```",
    "Rewrite this function so that it is easier to read, keeping its behaviour:\n\n```python\n{src}```",
]

GENERAL_TASKS = [
    ("reverse_words(sentence)", "reverses the order of the words in a sentence"),
    ("flatten(nested)", "flattens an arbitrarily nested list of lists into one flat list"),
    ("gcd(a, b)", "computes the greatest common divisor of two integers with Euclid's algorithm"),
    ("lcm(a, b)", "returns the least common multiple of two positive integers"),
    ("is_prime(n)", "checks whether an integer is prime by trial division"),
    ("primes_up_to(n)", "returns all prime numbers up to n with the sieve of Eratosthenes"),
    ("factorial(n)", "computes n factorial recursively and raises ValueError for negative n"),
    ("word_frequencies(text)", "returns a dictionary from each lower-cased word of a text to how often it occurs"),
    ("rotate_list(xs, k)", "rotates a list to the right by k positions"),
    ("transpose(matrix)", "transposes a matrix given as a list of rows"),
    ("dedupe(items)", "removes duplicates from a list while keeping the first occurrence order"),
    ("second_largest(nums)", "returns the second largest distinct number of a list, or None"),
    ("caesar(text, shift)", "encrypts a text with a Caesar cipher, leaving non-letters unchanged"),
    ("to_roman(n)", "converts a positive integer to a Roman numeral"),
    ("from_roman(s)", "converts a Roman numeral string to an integer"),
    ("anagrams(a, b)", "tells whether two strings are anagrams of each other"),
    ("run_length(s)", "run-length encodes a string, e.g. 'aaab' becomes 'a3b1'"),
    ("matrix_multiply(a, b)", "multiplies two matrices given as nested lists"),
    ("celsius_table(lo, hi)", "prints a table of Celsius temperatures and their Fahrenheit values"),
    ("digits_sum(n)", "returns the sum of the decimal digits of a non-negative integer"),
    ("bubble_sort(xs)", "sorts a list in place with bubble sort and returns it"),
    ("insertion_sort(xs)", "returns a sorted copy of a list using insertion sort"),
    ("merge_sort(xs)", "sorts a list with merge sort"),
    ("quick_sort(xs)", "sorts a list with quicksort using the first element as the pivot"),
    ("count_lines(path)", "counts the non-empty lines of a text file"),
    ("longest_word(text)", "returns the longest word in a text"),
    ("capitalize_words(text)", "capitalizes the first letter of every word of a text"),
    ("moving_average(xs, n)", "returns the moving averages of a list over windows of n values"),
    ("histogram(values)", "prints a text histogram with one row of stars per value"),
    ("parse_key_values(s)", "parses a string like 'a=1;b=2' into a dictionary"),
    ("valid_email(s)", "checks with a regular expression whether a string looks like an e-mail address"),
    ("tokenize_expr(s)", "splits an arithmetic expression into numbers, operators and parentheses"),
    ("evaluate_rpn(tokens)", "evaluates an expression in reverse Polish notation"),
    ("balanced(s)", "checks whether the brackets (), [] and {{}} in a string are balanced"),
    ("power_set(items)", "returns every subset of a list"),
    ("permutations_of(s)", "returns every permutation of a short string, without itertools"),
    ("binary_to_int(bits)", "converts a string of 0s and 1s to an integer without int(x, 2)"),
    ("int_to_binary(n)", "converts a non-negative integer to its binary string without bin()"),
    ("chunk_string(s, n)", "splits a string into pieces of n characters"),
    ("max_subarray(nums)", "returns the largest sum of a contiguous sub-list (Kadane's algorithm)"),
    ("two_sum(nums, target)", "returns the indices of two numbers that add up to target"),
    ("common_prefix(words)", "returns the longest common prefix of a list of strings"),
    ("pascal_triangle(n)", "returns the first n rows of Pascal's triangle"),
    ("leap_year(year)", "tells whether a year is a leap year in the Gregorian calendar"),
    ("days_between(d1, d2)", "returns the number of days between two dates given as 'YYYY-MM-DD' strings"),
    ("mean_median_mode(xs)", "returns the mean, median and mode of a list of numbers"),
    ("normalize(xs)", "scales a list of numbers linearly to the range 0 to 1"),
    ("dot(u, v)", "returns the dot product of two vectors given as lists"),
    ("queue_from_stacks()", "builds a FIFO queue class out of two lists used as stacks"),
    ("LinkedList", "is a singly linked list class with append, prepend, find and remove methods"),
    ("BankAccount", "is a class with deposit, withdraw and balance, refusing overdrafts"),
    ("Matrix", "is a small matrix class with addition, multiplication and a readable __repr__"),
    ("LRUCache", "is a least-recently-used cache class with get and put, built on OrderedDict"),
    ("Counter2D", "counts how often each (row, column) pair is seen and reports the most frequent"),
    ("Temperature", "stores a temperature in Celsius and exposes Fahrenheit and Kelvin properties"),
    ("Inventory", "tracks item names and quantities with add, remove and report methods"),
    ("TodoList", "manages tasks with add, complete, and a list of the pending ones"),
    ("Vector2", "is a 2D vector class with addition, scaling, length and a dot product"),
]
GENERAL_TEMPLATES = [
    "Write a Python function `{sig}` that {desc}. Include a docstring.",
    "In Python, write `{sig}`, which {desc}. Then show two example calls and their output.",
    "Create `{sig}` in Python: it {desc}. Explain the approach in two sentences first.",
]
CLASS_GENERAL_TEMPLATES = [
    "Write a Python class `{sig}` that {desc}. Add docstrings.",
    "Implement `{sig}` in Python, a class that {desc}, and demonstrate it with a few lines of code.",
]

NAMES = ["Maya", "Omar", "Lena", "Jonas", "Priya", "Diego", "Chloe", "Kenji", "Amara", "Felix", "Noor", "Ivan", "Sofia", "Tariq", "Hana", "Lucas"]
ITEMS = ["apples", "pencils", "stickers", "books", "cookies", "stamps", "shells", "cards", "eggs", "bottles", "coins", "tickets"]
PLACES = ["shop", "library", "farm", "school fair", "garage sale", "bakery stall", "market"]
ARITH_TEMPLATES = [
    "{a} has {x} {item}. {b} gives {a} {y} more, and then {a} uses {z} of them. How many {item} does {a} own now? Work it out step by step.",
    "A {place} sells {item} in packs of {x}. {a} buys {y} packs and shares them equally among {z} friends. "
    "How many {item} does each friend get, and how many are left over? Show each step.",
    "{a} earns {x} dollars a week and saves {p} percent of it. How much does {a} save in {y} weeks? Explain the calculation.",
    "A rectangle has a length of {x} cm and a width of {y} cm. What are its area and its perimeter? Show the formulas you use.",
    "{a} reads {x} pages on Monday and {y} pages on each of the next {z} days. How many pages has {a} read in total? Give a step-by-step answer.",
    "At the {place}, {item} cost {x} cents each. {a} pays with a {y}-dollar note for {z} of them. "
    "How much change does {a} get? Solve it step by step.",
    "A car uses {x} litres of fuel per 100 km. How much fuel does it need for a trip of {y} km? Explain your reasoning.",
    "{a} is {x} years old and {b} is {y} years older. In {z} years, what will the sum of their ages be? Show your working.",
    "A tank holds {x} litres. It is filled at {y} litres per minute. How many minutes does it take to fill it from empty? Round up and explain.",
    "{a} and {b} share {x} {item} in the ratio {y}:{z}. How many {item} does each person get? Explain the steps.",
    "A class has {x} students. {p} percent of them walk to school and the rest take the bus. How many take the bus? Show how you get the answer.",
    "What is {x} multiplied by {y}, minus {z}? Write out each step of the calculation.",
]

# --- installed packages, documentation text, multi-turn chats (prompts.py, pysource.py) ----------------

PACKAGES = [  # read with ast (pysource.py), nothing imported; those not installed are skipped
    "stdlib", "numpy", "pandas", "scipy", "sklearn", "sympy", "networkx", "requests", "urllib3", "httpx", "click", "typer",
    "rich", "pygments", "jinja2", "markdown", "markdown_it", "flask", "werkzeug", "starlette", "fastapi", "attr", "dateutil",
    "yaml", "omegaconf", "hydra", "pydantic", "fsspec", "huggingface_hub", "datasets", "transformers", "tokenizers", "torch",
    "matplotlib", "pyparsing", "packaging", "prettytable", "tqdm", "sqlalchemy", "alembic", "mako", "git", "joblib", "mlflow",
    "_pytest", "pluggy", "setuptools", "fire", "docker", "anyio", "h11", "idna", "cachetools", "sqlparse", "gguf", "safetensors",
    "accelerate", "PIL", "regex", "psutil", "termcolor", "wcwidth", "xxhash", "yarl", "multidict", "aiohttp", "graphene",
]
PKG_CODE_TEMPLATES = [
    "Write a Python function `{name}{sig}` that does the following: {summary} Keep it simple and add a docstring.",
    "The `{pkg}` package has `{qual}`. Its documentation says: \"{summary}\" Explain what it is for and show a small example.",
    "Implement a simplified, self-contained version of `{name}` in pure Python. Its documentation says: \"{summary}\"",
    "What does `{qual}` do? Explain it to a beginner and give an example call with its output.",
    "Write pytest tests for a function `{name}{sig}` whose documentation reads: \"{summary}\"",
    "Describe the arguments of `{name}{sig}` and what each is for, given that it does this: {summary}",
    "I need a function that does this: {summary} Write it in Python with type hints, a docstring and two examples.",
]
PKG_CLASS_TEMPLATES = [
    "Explain the purpose of the class `{qual}` from the `{pkg}` package and show how it is typically used.",
    "Write a small Python class named `{name}` that does this: {summary} Add docstrings and a usage example.",
    "Design a minimal version of `{name}` (\"{summary}\") in pure Python and explain your design choices.",
]
PKG_SOURCE_TEMPLATES = [
    "Explain what this Python code from the `{pkg}` package does, step by step:\n\n```python\n{src}```",
    "Add type hints and a clearer docstring to this function:\n\n```python\n{src}```",
    "Rewrite this function so that it is easier to read, keeping its behaviour:\n\n```python\n{src}```",
    "Write unit tests for this function:\n\n```python\n{src}```",
    "Are there any bugs or edge cases this function does not handle? Explain.\n\n```python\n{src}```",
    "What is the time complexity of this function? Explain briefly.\n\n```python\n{src}```",
    "Summarize in two sentences what this code does:\n\n```python\n{src}```",
]
DOC_TEMPLATES = [
    "Explain the following documentation in plain words:\n\n{doc}",
    "Summarize this passage in three bullet points:\n\n{doc}",
    "Here is part of the documentation of `{qual}`:\n\n{doc}\n\nWrite a short example that shows what it describes.",
    "Read this text and write three questions a beginner might ask about it, with their answers:\n\n{doc}",
    "Rewrite this paragraph so that it is shorter and clearer:\n\n{doc}",
]
TASK_SUFFIXES = [
    "", " Include a docstring.", " Then show three test cases.", " Explain its time complexity.", " Add a short usage example.",
    " Use type hints.", " Keep it short.", " Explain the approach first.", " Handle invalid input with a clear error.",
]
FOLLOWUPS = [  # second user turns of the multi-turn chats
    "Now write unit tests for it.", "Can you make it shorter?", "Explain the time and space complexity.",
    "Add error handling for invalid input.", "Give two more examples of how to use it.", "Summarize your answer in three sentences.",
    "What edge cases should I watch out for?", "Rewrite it as a class.", "Add type hints and comments.",
    "How would you explain this to a beginner?", "Can you do it without any imports?", "Is there a faster way to do this?",
    "Convert the example into a small command-line program.", "What would change if the input were very large?",
    "Now solve the same problem with different numbers of your choice.", "Check your answer another way.",
]
