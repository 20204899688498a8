//! Chat templates as transformers renders them: Jinja with `trim_blocks` and `lstrip_blocks`,
//! loop controls, `raise_exception`, `tojson`, and Python's string methods (minijinja-contrib's
//! pycompat), so a real Qwen 3.5 directory works with its own template.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

use super::TextError;

/// One chat message.
#[derive(Clone, Debug, Serialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, …
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message.
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl ChatTemplate {
    /// Compile a template source.
    pub fn new(source: String) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source).map_err(|e| TextError::Template(e.to_string()))?;
        Ok(Self { env })
    }

    /// Render `messages`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String, TextError> {
        let t = self.env.get_template("chat").map_err(|e| TextError::Template(e.to_string()))?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token.unwrap_or(""),
            eos_token => eos_token.unwrap_or(""),
        })
        .map_err(|e| TextError::Template(e.to_string()))
    }
}
