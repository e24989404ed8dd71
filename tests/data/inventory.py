"""A small inventory module used as a real file in ember's end-to-end tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0
    tags: list[str] = field(default_factory=list)

    def total(self) -> float:
        return self.price * self.quantity


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.name in self.items:
            self.items[item.name].quantity += item.quantity
        else:
            self.items[item.name] = item

    def remove(self, name: str) -> Item | None:
        return self.items.pop(name, None)

    def total_value(self) -> float:
        return sum(item.total() for item in self.items.values())

    def to_json(self) -> str:
        return json.dumps({name: item.__dict__ for name, item in self.items.items()})


def load_inventory(path: str) -> Inventory:
    inventory = Inventory()
    with open(path) as f:
        data = json.load(f)
    for name, fields in data.items():
        inventory.add(Item(**fields))
    return inventory
