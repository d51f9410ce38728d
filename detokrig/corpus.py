"""The multilingual text the benchmarks decode: real text in several scripts (English,
Chinese, Russian, Arabic, Hindi, emoji sequences, code), shared by bench, scale and
sglang-bench so their figures are for the same text."""

from __future__ import annotations

TEXTS: dict[str, str] = {
    "english": (
        "The lighthouse keeper had not spoken to anyone in eleven days when the supply boat "
        "finally rounded the northern point. She watched it through the salt-streaked window, "
        "counting the waves that broke over its bow, and wondered whether the captain would "
        "remember the coffee this time. Fog was rolling in from the west, thick and grey, the "
        "kind that swallowed sound as well as light.\n"
        "Streaming detokenization turns token ids back into text while a model is still "
        "generating. It must never emit half of a character, must keep the leading space of a "
        "word, and should cost the same for the ten-thousandth token as for the first."
    ),
    "chinese": (
        "清晨的山谷里弥漫着薄雾，远处传来几声鸟鸣。老人背着竹篓，沿着蜿蜒的小路慢慢走向茶园。"
        "他在这里种了四十年的茶，每一棵茶树的脾气他都了如指掌。今年春天雨水充足，新芽长得格外鲜嫩。\n"
        "大型语言模型在生成文本时逐个输出词元，服务系统需要把这些词元实时转换成文字并推送给用户。"
        "如果一个汉字的字节被拆分到两个词元中，解码器必须等到字符完整后再发送，否则用户会看到乱码。"
    ),
    "russian": (
        "Поезд опаздывал уже на сорок минут, и на перроне становилось всё холоднее. Старик в "
        "потёртом пальто достал из кармана термос, налил себе чаю и предложил соседке. Она "
        "улыбнулась, поблагодарила и рассказала, что едет к сестре, которую не видела двадцать лет.\n"
        "Каждый токен модели превращается в несколько байтов, а кириллическая буква занимает два "
        "байта в UTF-8, поэтому граница токена иногда проходит прямо посередине символа."
    ),
    "arabic": (
        "في صباح يوم هادئ، خرجت الجدة إلى حديقتها الصغيرة لتسقي أشجار الليمون والزيتون. كانت الشمس "
        "تشرق ببطء فوق أسطح المنازل، والعصافير تغرد على الأغصان. جلست على كرسيها الخشبي وأخذت تتذكر "
        "أيام طفولتها في القرية.\n"
        "تعمل النماذج اللغوية الكبيرة على توليد النص كلمة بعد كلمة، ويجب على الخادم أن يحول الرموز "
        "إلى نص مقروء بسرعة كبيرة ومن دون أخطاء في ترميز الحروف."
    ),
    "hindi": (
        "गाँव के किनारे एक पुराना बरगद का पेड़ था, जिसकी छाँव में बच्चे हर शाम खेलने आते थे। दादी "
        "वहीं बैठकर कहानियाँ सुनाती थीं — राजा-रानी की, चतुर लोमड़ी की, और उस नदी की जो कभी सूखती नहीं थी।\n"
        "देवनागरी के अक्षर UTF-8 में तीन बाइट लेते हैं, और मात्राएँ अलग कोड पॉइंट होती हैं, इसलिए "
        "टोकन की सीमा अक्सर किसी अक्षर के बीच में पड़ती है।"
    ),
    "emoji": (
        "Launch day! 🚀🎉 The team 👩‍💻👨‍💻🧑🏽‍🔬 shipped at 3am ☕☕☕ and the dashboards are all green ✅✅. "
        "Weather: 🌧️ → ⛅ → ☀️. Flags seen at the meetup: 🇯🇵 🇧🇷 🇰🇪 🇩🇪 🇮🇳 🏳️‍🌈. "
        "Family photo: 👨‍👩‍👧‍👦 with the dog 🐕‍🦺 and the robot 🤖. Reactions: 👍🏻 👍🏿 ❤️‍🔥 🫶 😂🤣 🥲 🫠."
    ),
    "code": (
        "def stream_decode(tokenizer, ids, prefix_offset=0, read_offset=0):\n"
        "    \"\"\"Yield text deltas; hold back incomplete UTF-8 sequences.\"\"\"\n"
        "    for i in range(len(ids)):\n"
        "        prefix = tokenizer.decode(ids[prefix_offset:read_offset])\n"
        "        full = tokenizer.decode(ids[prefix_offset:i + 1])\n"
        "        if len(full) > len(prefix) and not full.endswith(\"\\ufffd\"):\n"
        "            yield full[len(prefix):]\n"
        "            prefix_offset, read_offset = read_offset, i + 1\n"
        "\n"
        "const cache = new Map<string, number[]>();\n"
        "for (const [k, v] of Object.entries(cfg)) { if (v?.enabled) cache.set(k, v.ids ?? []); }\n"
        "SELECT rid, COUNT(*) AS n FROM tokens WHERE step >= 42 GROUP BY rid HAVING n > 1;\n"
    ),
}

TAIL = 4  # prompt ids of context each stream starts with


def corpus() -> str:
    """Every text, one after the other."""
    return "\n\n".join(TEXTS[k] for k in TEXTS) + "\n\n"
