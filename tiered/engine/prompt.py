"""Prompts as token ids, and whether they fit the context window.

Used by LLM for every request and by the CLI before the engine is built, so a prompt that cannot
run is refused before any weight is loaded or this machine is measured for the planner.
"""

from __future__ import annotations

from tiered.checkpoint.model_config import ModelConfig
from tiered.errors import ConfigError, ContextLengthError

Prompt = str | list[dict] | list[int]


def encode_prompt(tokenizer, prompt: Prompt, chat: bool | None = None, add_generation_prompt: bool = True,
                  add_special_tokens: bool = True, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
    """Token ids of a prompt: a string, a list of chat messages, or token ids (returned as they are).

    Args:
        tokenizer: a transformers tokenizer, or None (then only token ids are accepted).
        chat: apply the tokenizer's chat template to a string; None = when it has one. Message
            lists always use it.
        add_generation_prompt: end a chat with the assistant's turn opening (vLLM's /tokenize may not).
        add_special_tokens: a plain text's BOS where the tokenizer adds one.
        tools: OpenAI-style tool definitions the chat template renders (transformers' `tools`); chat only.
        template_kwargs: more variables for the chat template (Qwen3's `enable_thinking`, gpt-oss's
            `reasoning_effort`); chat only.
        continue_final: the conversation's last message left open, for the model to continue (transformers'
            continue_final_message: an assistant's prefill, Anthropic's prefilled answer); no generation prompt.
    Raises:
        ConfigError: text without a tokenizer, chat without a chat template, or a conversation the template
            refuses (its raise_exception: roles out of order, a tool turn without a call, ...).
    """
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return list(prompt)
    if tokenizer is None:
        raise ConfigError("this checkpoint has no tokenizer", "pass token ids instead of text")
    use_chat = isinstance(prompt, list) or (chat if chat is not None else bool(getattr(tokenizer, "chat_template", None)))
    if use_chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this model's tokenizer has no chat template", "use chat=False / --no-chat")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt and not continue_final,
                                                 **({"continue_final_message": True} if continue_final else {}),
                                                 **({"tools": tools} if tools else {}), **(template_kwargs or {}))
        except TemplateError as e:  # the template's raise_exception (roles out of order, ...), or its own bug
            raise ConfigError(f"the chat template refused the conversation: {e}",
                              "check the messages' roles and order (and any template variables)") from None
        except ValueError as e:  # continue_final_message: the template does not write the last message as sent
            if not continue_final:
                raise
            raise ConfigError(f"the last message cannot be continued: {e}",
                              "send it as it is, or leave continue_final_message out") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]


def is_chat(tokenizer, prompt: Prompt, chat: bool | None) -> bool:
    """Whether `prompt` is (or, given as token ids, is declared by `chat=True` to be) a conversation rendered by the
    chat template, as encode_prompt renders it: then its output follows the template's reasoning format
    (engine/reasoning.py)."""
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return bool(chat)
    return isinstance(prompt, list) or (chat if chat is not None else bool(getattr(tokenizer, "chat_template", None)))


def context_window(config: ModelConfig, max_context: int | None) -> int:
    """The engine's context window [tokens]: `max_context` (None = the model's), at most the
    model's max_position_embeddings."""
    return min(max_context or config.max_position_embeddings, config.max_position_embeddings)


def check_prompt_fits(index: int, num_tokens: int, window: int, model_window: int) -> None:
    """Refuse prompt number `index` of `num_tokens` tokens unless 1 <= num_tokens < `window` (one
    position stays for the first generated token).

    Raises:
        ConfigError: the prompt is empty.
        ContextLengthError: it does not fit; the hint offers raising max_context while `window`
            is below the model's own `model_window`.
    """
    if not num_tokens:
        raise ConfigError(f"prompt {index} is empty", "pass at least one token")
    if num_tokens >= window:
        raise ContextLengthError(f"prompt {index} has {num_tokens} tokens; the context window is {window}",
                                 "shorten the prompt" + ("" if window == model_window else " or raise max_context"))
