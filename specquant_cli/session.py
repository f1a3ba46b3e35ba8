"""A conversation: route each prompt, pick the plan, stream the answer as response records."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

from specquant_cli.policies import Plan, check_policy, plan_for
from specquant_cli.router import Route, Router
from specquant_cli.runtime import Runtime
from specquant_cli.sampling import SamplingParams
from specquant_cli.stream import Response, stream_generate


@dataclass
class Answer:
    prompt: str
    route: Route
    plan: Plan
    text: str = ""
    last: Optional[Response] = None
    route_s: float = 0.0  # spaCy scoring time, before generation starts

    def to_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "route": {"tier": self.route.tier, "score": self.route.score, "features": self.route.features,
                      "policy": self.plan.policy, "plan": self.plan.describe(), "lossy": self.plan.lossy},
            "text": self.text,
            "finish_reason": self.last.finish_reason if self.last else None,
            "stats": self.last.stats() if self.last else {},
        }


@dataclass
class ChatSession:
    runtime: Runtime
    router: Router
    policy: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    system: Optional[str] = None
    stop: Sequence[str] = ()
    history: list[dict] = field(default_factory=list)
    last: Optional[Answer] = None

    def set_policy(self, name: str) -> None:
        self.policy = check_policy(name)

    def reset(self) -> None:
        self.history.clear()

    def plan(self, text: str) -> tuple[Route, Plan]:
        route = self.router.route(text)
        return route, plan_for(self.policy, route.tier)

    def messages(self, text: str) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.history + [{"role": "user", "content": text}]

    def ask(self, text: str, remember: bool = True) -> tuple[Answer, Iterator[Response]]:
        """Route and plan now; the returned iterator generates (and fills `answer` as it goes)."""
        t0 = time.perf_counter()
        route, plan = self.plan(text)
        answer = Answer(text, route, plan, route_s=time.perf_counter() - t0)
        engine = self.runtime.engine(plan, self.sampling)
        prompt = engine.parent.model.chat_prompt(self.messages(text))

        def run() -> Iterator[Response]:
            parts = []
            for rec in stream_generate(engine, prompt, self.max_tokens, self.stop):
                parts.append(rec.text)
                answer.last = rec
                yield rec
            answer.text = "".join(parts)
            if remember:
                self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer.text}]
            self.last = answer

        return answer, run()
