"""The structured-output workloads of pdserve's tests and benchmarks: five Pydantic models
(nested objects, arrays, enums, optional fields, bounded numbers), each with a prompt that
asks for it and a valid output, and a tool with its argument schema.

Strings and arrays are bounded (``max_length``), as a user who wants an answer in a bounded
number of tokens writes them."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field


class Address(BaseModel):
    street: str = Field(max_length=60)
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(BaseModel):
    """Nested objects."""

    name: str = Field(max_length=40)
    age: int
    address: Address


class Ingredient(BaseModel):
    name: str = Field(max_length=20)
    quantity: float
    unit: str = Field(max_length=10)


class Recipe(BaseModel):
    """Arrays of objects and of strings."""

    title: str = Field(max_length=40)
    ingredients: list[Ingredient] = Field(max_length=3)
    steps: list[str] = Field(max_length=3)


class Priority(StrEnum):
    low = "low"
    medium = "medium"
    high = "high"


class Ticket(BaseModel):
    """Enums: an Enum class and a Literal."""

    category: Literal["bug", "feature", "question"]
    priority: Priority
    summary: str = Field(max_length=80)


class Contact(BaseModel):
    """Optional fields (in OpenAI's strict mode: required, and null allowed)."""

    name: str = Field(max_length=40)
    email: str | None = Field(default=None, max_length=60)
    phone: str | None = Field(default=None, max_length=20)


class Review(BaseModel):
    """Bounded numbers."""

    score: int = Field(ge=1, le=5)
    confidence: float = Field(ge=0, le=1)
    verdict: str = Field(max_length=60)


MODELS: dict[str, type[BaseModel]] = {
    "nested objects": Person,
    "arrays": Recipe,
    "enums": Ticket,
    "optional fields": Contact,
    "bounded numbers": Review,
}

SCHEMAS = {name: model.model_json_schema() for name, model in MODELS.items()}

SAMPLE_OUTPUTS = {
    "nested objects": json.dumps(
        {
            "name": "Ada Lovelace",
            "age": 36,
            "address": {"street": "12 St James's Square", "city": "London", "country": "UK"},
        }
    ),
    "arrays": json.dumps(
        {
            "title": "Pancakes",
            "ingredients": [
                {"name": "flour", "quantity": 200, "unit": "g"},
                {"name": "milk", "quantity": 0.3, "unit": "l"},
            ],
            "steps": ["Mix.", "Fry."],
        }
    ),
    "enums": json.dumps({"category": "bug", "priority": "high", "summary": "Crash on start"}),
    "optional fields": json.dumps({"name": "Bob", "email": None, "phone": "555-0100"}),
    "bounded numbers": json.dumps({"score": 4, "confidence": 0.8, "verdict": "Good value"}),
}

# Prompts that ask for each model's object: {subject} is one of SUBJECTS.
PROMPTS = {
    "nested objects": "Describe {subject} as a person with a name, an age and an address.",
    "arrays": "Write a short recipe inspired by {subject}.",
    "enums": "File a support ticket about {subject}.",
    "optional fields": "Give the contact details of someone who works on {subject}.",
    "bounded numbers": "Review {subject} with a score from 1 to 5.",
}

SUBJECTS = [
    "a lighthouse keeper",
    "the city of Lyon",
    "a broken coffee machine",
    "a mountain bike",
    "the printer on the third floor",
    "a jazz pianist",
    "a bakery in Naples",
    "an old sailing boat",
    "a spreadsheet that will not open",
    "a vegetable garden",
    "a night train to Vienna",
    "a chess club",
    "a solar panel",
    "a school library",
    "a lost umbrella",
    "a video game about space",
    "a pair of running shoes",
    "a thunderstorm",
    "a small museum of clocks",
    "a noisy neighbour",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
