"""The prompts a head is distilled on: a built-in mixed corpus, or the user's JSONL file.

The built-in corpus is written for this project: instruction templates crossed with topics,
in six kinds (open chat, explain/compare, short writing, code, summarise/extract over a given
paragraph, JSON answers), interleaved so that any prefix of it mixes every kind.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "compound interest", "vaccines", "the French Revolution",
    "machine learning", "volcanoes", "recycling", "the human heart", "electric cars", "coffee", "chess",
    "the internet", "honey bees", "climate change", "the Roman Empire", "sleep", "solar panels", "DNA",
    "the stock market", "gravity", "rainbows", "baking bread", "jazz", "the Moon", "earthquakes", "antibiotics",
    "democracy", "bicycles", "the printing press", "ocean tides", "web caching", "relational databases",
    "public-key encryption", "time zones", "meditation", "marathon training", "glaciers", "the immune system",
    "prime numbers", "hash tables", "GPS", "3D printing", "wind turbines", "origami", "composting",
    "the Olympic Games", "volunteering", "learning a second language", "houseplants", "the speed of light",
    "saving money", "job interviews", "public speaking", "time management", "healthy breakfasts", "camping",
    "remote work", "learning to code", "photography", "gardening in small spaces", "running a small business",
    "writing a novel", "dinosaurs", "the solar system", "ancient Egypt", "the Renaissance", "World War I",
    "the Industrial Revolution", "the Silk Road", "quantum computers", "artificial intelligence", "smartphones",
    "social media", "video games", "cybersecurity", "open-source software", "cloud computing", "batteries",
    "nuclear energy", "rain forests", "deserts", "coral reefs", "migrating birds", "octopuses", "elephants",
    "the human brain", "nutrition", "vitamins", "stress", "exercise", "first aid", "allergies", "the common cold",
    "music theory", "learning the guitar", "painting with watercolors", "classical music", "movies", "poetry",
    "board games", "football", "tennis", "yoga", "hiking", "travelling on a budget", "packing for a trip",
    "cooking pasta", "making soup", "fermentation", "chocolate", "spices", "tea ceremonies", "city planning",
    "public transport", "architecture", "bridges", "skyscrapers", "plastic pollution", "electric grids",
    "inflation", "taxes", "personal budgets", "credit cards", "negotiation", "friendship", "parenting",
    "pets", "training a puppy", "keeping fish", "reading habits", "libraries", "museums", "languages of the world",
)

PAIRS = (
    ("cats", "dogs"), ("tea", "coffee"), ("Python", "JavaScript"), ("trains", "planes"), ("renting", "buying a home"),
    ("solar power", "wind power"), ("paper books", "e-readers"), ("a list", "a tuple in Python"),
    ("TCP", "UDP"), ("viruses", "bacteria"), ("weather", "climate"), ("SQL", "NoSQL databases"),
    ("running", "swimming"), ("stocks", "bonds"), ("a comet", "an asteroid"), ("git merge", "git rebase"),
)

CHAT = (
    "What is {t}?", "Why does {t} matter?", "Give me three interesting facts about {t}.",
    "How would you explain {t} to a ten-year-old?", "What are common misconceptions about {t}?",
    "What should a beginner know about {t}?", "Tell me something surprising about {t}.",
    "I want to learn more about {t}. Where should I start?", "What are some good tips related to {t}?",
    "Can you give me a simple overview of {t}?", "What questions do people often ask about {t}, and what are the answers?",
    "Explain in simple words why {t} is important in everyday life.",
)
EXPLAIN = (
    "Explain how {t} works.", "Describe {t} in a short paragraph.", "What are the pros and cons of {t}?",
    "Explain the history of {t} in a few sentences.", "List the main steps involved in {t}.",
)
COMPARE = ("Compare {a} and {b}.", "What is the difference between {a} and {b}?", "Should I choose {a} or {b}? Why?")
WRITING = (
    "Write a haiku about {t}.", "Write a short poem about {t}.", "Write a two-sentence story involving {t}.",
    "Write a friendly email inviting a colleague to a talk about {t}.", "Write a catchy slogan about {t}.",
    "Write a short blog introduction about {t}.", "Write a limerick about {t}.",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "returns the n-th Fibonacci number", "merges two sorted lists", "removes duplicates from a list keeping order",
    "computes the average of a list of numbers", "converts Celsius to Fahrenheit", "finds the largest element in a list",
    "checks whether a string is a palindrome", "flattens a nested list", "counts how often each character appears",
    "validates an email address with a simple rule", "reads a CSV file and returns its rows",
)
CODE = (
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "How would you write a function that {c} in Python? Explain briefly.", "Write a unit test for a function that {c}.",
)
SNIPPETS = (
    "def f(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n            total += x\n    return total",
    "def g(s):\n    return s == s[::-1]",
    "def h(n):\n    if n < 2:\n        return n\n    return h(n - 1) + h(n - 2)",
    "def k(d):\n    return sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:3]",
    "def avg(xs):\n    return sum(xs) / len(xs)",
)
SNIPPET_ASKS = (
    "Explain what this code does:\n```python\n{s}\n```", "Is there a bug in this function? ```python\n{s}\n```",
    "Add comments to this code:\n```python\n{s}\n```", "Rewrite this function with a clearer name:\n```python\n{s}\n```",
)
PARAGRAPHS = (
    ("The town of Brindle opened its first public library in 1892 with 340 books donated by a local miller. "
     "By 1950 the collection had grown to 12,000 volumes, and in 2004 the library moved into a renovated "
     "railway station, where it now also offers language classes and a repair cafe."),
    ("Maria Okafor, a marine biologist, spent three years counting sea turtles on the coast of Ghana. Her team "
     "tagged 215 turtles and found that nesting had dropped by a third since 2010, mostly where beaches were lit "
     "at night."),
    ("Our quarterly report shows revenue of 4.2 million dollars, up 8 percent from the previous quarter. Costs "
     "rose 5 percent, driven by hiring in the support team, and the company now has 57 employees in two offices."),
    ("To repot a houseplant, water it a day before, choose a pot one size larger, loosen the root ball gently, "
     "add fresh soil around it, and keep the plant out of direct sun for a week while the roots settle."),
    ("The Aurora train leaves Oslo at 07:15 and reaches Bergen at 14:05, crossing the Hardanger plateau at 1,222 "
     "meters. Tickets cost between 299 and 1,100 kroner, and a dining car serves meals until 13:00."),
    ("Kenji started a small bakery in 2015 with one oven and a borrowed mixer. He now bakes 600 loaves a day, "
     "employs nine people, and donates unsold bread every evening to a shelter on Elm Street."),
    ("A new study of 1,800 adults found that people who walked at least 7,000 steps a day had a lower risk of "
     "heart disease. The researchers noted that the benefit leveled off above about 10,000 steps."),
    ("The conference will take place in Lisbon from 12 to 14 June. Talks cover distributed systems, compilers and "
     "developer tools; registration closes on 30 April, and students pay half the regular price of 400 euros."),
)
PARAGRAPH_ASKS = (
    "Summarise the following text in one sentence.\n\n{p}", "List the key facts in this text as bullet points.\n\n{p}",
    "Extract every number in the text and say what it refers to.\n\n{p}", "What is the main idea of this text?\n\n{p}",
    "Give this paragraph a short title.\n\n{p}", "Write two questions a reader might ask after reading this:\n\n{p}",
)
JSON_ASKS = (
    'Return a JSON object with the keys "name", "category" and "summary" describing {t}. Answer with JSON only.',
    'List three terms related to {t} as a JSON array of objects with "term" and "definition". Answer with JSON only.',
    'Give a JSON object with "question" and "answer" for a quiz about {t}.',
)
JSON_EXTRACT = (
    'Extract the people, places and dates from this text as JSON with keys "people", "places", "dates".\n\n{p}',
    "Convert the numbers in this text into a JSON list of objects with \"value\" and \"meaning\".\n\n{p}",
)


def _kinds() -> list[list[str]]:
    """Every built-in prompt, grouped by kind."""
    chat = [q.format(t=t) for q in CHAT for t in TOPICS]
    explain = [q.format(t=t) for q in EXPLAIN for t in TOPICS] + [q.format(a=a, b=b) for q in COMPARE for a, b in PAIRS]
    writing = [q.format(t=t) for q in WRITING for t in TOPICS]
    code = [q.format(c=c) for q in CODE for c in CODE_TASKS] + [q.format(s=s) for q in SNIPPET_ASKS for s in SNIPPETS]
    extract = [q.format(p=p) for q in PARAGRAPH_ASKS for p in PARAGRAPHS]
    json_answers = [q.format(t=t) for q in JSON_ASKS for t in TOPICS]
    json_answers += [q.format(p=p) for q in JSON_EXTRACT for p in PARAGRAPHS]
    return [chat, explain, writing, code, extract, json_answers]


def builtin_prompts(num_prompts: int, seed: int) -> list[list[dict]]:
    """Up to `num_prompts` distinct single-turn conversations, the kinds taken in turn (each shuffled by `seed`)."""
    rng = random.Random(seed)
    kinds = _kinds()
    for prompts in kinds:
        rng.shuffle(prompts)
    mixed = []
    for i in range(max(len(k) for k in kinds)):
        mixed += [k[i] for k in kinds if i < len(k)]
    return [[{"role": "user", "content": text}] for text in mixed[:num_prompts]]


def builtin_size() -> int:
    """How many distinct prompts the built-in corpus holds."""
    return sum(len(k) for k in _kinds())


def load_prompts(path: str | Path) -> list[list[dict]]:
    """Conversations from a JSONL file: one {"prompt": str} or {"messages": [...]} object a line."""
    conversations = []
    for num, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompts: line {num} of {path} is not JSON: {exc}") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            conversations.append([{"role": "user", "content": item["prompt"]}])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
            conversations.append(item["messages"])
        else:
            raise ValueError(f'prompts: line {num} of {path} needs a "prompt" string or a non-empty "messages" list')
    if not conversations:
        raise ValueError(f"prompts: {path} holds no prompts")
    return conversations
