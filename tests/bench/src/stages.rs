//! Where a chat decision's time goes, stage by stage, in-process.

use super::*;

/// Times, in-process and one prompt at a time, each step a chat decision takes before the index:
/// body parse, the owned copy for the tokenizer, the `messages` JSON tree, the template render,
/// the encode and the block keys — the steps of `InProcessTokenizer` and `Pool::prompt_keys`
/// (`Match` and scoring are in the extproc bench's own timings). Median and worst per step. Then
/// the same prompt's leading part alone (`ModelTokenizer::encode_chat_leading` from
/// [`LEADING_BYTES`]: render + encode up to the first exact cut) and its keys: what a decision
/// that matches only the leading part would spend on it.
pub(super) fn stages_bench(prompts: &PromptSource, count: usize) -> anyhow::Result<()> {
    const STEPS: [&str; 8] = [
        "parse",
        "copy",
        "messages",
        "render",
        "encode",
        "keys",
        "lead render+encode",
        "lead keys",
    ];
    println!(
        "## stages: one chat decision's steps before Match, {count} new conversations per size, load {}\n",
        load_average()
    );
    println!(
        "| prompt tokens | body KiB | {} | total ms (median, without lead) | lead tokens |",
        STEPS.map(|s| format!("{s} ms")).join(" | ")
    );
    println!("|---:|---:|{}---:|---:|", "---:|".repeat(STEPS.len()));
    let pool = prompts.keys.pools.first().context("no pool")?;
    let options = kvroute_tokenize::ChatOptions::default();
    for tokens in STAGE_SIZES {
        let mut times: Vec<Vec<Duration>> = vec![Vec::with_capacity(count); STEPS.len() + 1];
        let mut measured = (0, 0);
        let mut lead_tokens = 0;
        for _ in 0..count {
            let body = prompts.miss_body(tokens);
            let mut lap = Instant::now();
            let mut step = |times: &mut Vec<Vec<Duration>>, i: usize| {
                times[i].push(lap.elapsed());
                lap = Instant::now();
            };
            let started = Instant::now();
            let parsed = request::parse(&body, Endpoint::ChatCompletions)?;
            step(&mut times, 0);
            let input = kvroute_ext_proc::tokenizer::TokenizeInput::from_prompt(&parsed.prompt)
                .context("no chat prompt")?;
            step(&mut times, 1);
            let kvroute_ext_proc::tokenizer::TokenizeInput::Chat { messages, .. } = &input else {
                bail!("not a chat prompt");
            };
            let messages: serde_json::Value = serde_json::from_str(messages.get())?;
            step(&mut times, 2);
            let text = prompts.tokenizer.render_chat_with(&messages, &options)?;
            step(&mut times, 3);
            let ids = prompts.tokenizer.encode_prompt(&text, false)?;
            step(&mut times, 4);
            let keys = std::hint::black_box(pool.prompt_keys(&ids, None, None)?);
            step(&mut times, 5);
            times[STEPS.len()].push(started.elapsed());
            let leading =
                prompts
                    .tokenizer
                    .encode_chat_leading(&messages, &options, LEADING_BYTES)?;
            step(&mut times, 6);
            let lead_keys = std::hint::black_box(pool.prompt_keys(&leading.tokens, None, None)?);
            step(&mut times, 7);
            ensure!(
                ids.starts_with(&leading.tokens),
                "leading tokens are not the prompt's first tokens"
            );
            measured = (ids.len(), body.len());
            lead_tokens = leading.tokens.len();
            drop((keys, lead_keys));
        }
        let cell = |samples: &[Duration]| {
            let (p50, _) = quantiles(samples);
            let worst = samples.iter().max().copied().unwrap_or_default();
            format!("{:.3} (max {:.3})", ms(p50), ms(worst))
        };
        println!(
            "| {} | {} | {} | {:.3} | {lead_tokens} |",
            measured.0,
            measured.1 / 1024,
            times[..STEPS.len()]
                .iter()
                .map(|t| cell(t))
                .collect::<Vec<_>>()
                .join(" | "),
            ms(quantiles(&times[STEPS.len()]).0),
        );
    }
    println!();
    Ok(())
}
